"""The launcher's supervisor: stopping a run ends every process its services started."""

from __future__ import annotations

from pathlib import Path

import psutil

from tandem.supervisor import Supervisor
from tests.helpers import wait_until


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stopping_a_run_ends_what_a_service_that_already_died_left_running(
    tmp_path: Path,
) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    pid_file = tmp_path / "left.pid"
    # A service that starts a process of its own and dies first (as a trainer killed by
    # SIGKILL would): its process is left in the service's session.
    script = f"sleep 300 & echo $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}"
    child = supervisor.start("svc", [], ready=False, program=["sh", "-c", script])
    assert child.proc.wait(timeout=10) == 0
    left = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the pid file"))
    assert not gone(left), "the service's own process outlives it"
    supervisor.stop_all(timeout_s=5)
    wait_until(lambda: gone(left), f"process {left} to end with the run", timeout_s=10)
