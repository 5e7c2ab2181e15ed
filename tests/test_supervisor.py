"""The launcher's supervisor: stopping a run ends every process its services started."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tandem.supervisor import ChildFailedError, StartInterruptedError, Supervisor
from tandem.up_run import UpRun
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


def test_a_service_that_fails_to_start_is_reported_by_its_own_one_line_error(
    tmp_path: Path,
) -> None:
    """Its traceback stays in its log; a crash without that line shows the log's tail."""
    supervisor = Supervisor(tmp_path / "logs")
    said = "echo 'Traceback (most recent call last):'; echo '  ValueError: x'; echo"
    clean = f"{said}; echo 'tandem router: start-up failed: --x 3: must be even'; exit 1"
    crash = f"{said}; echo 'Segmentation fault'; exit 139"
    for script, shown, hidden in ((clean, "must be even", "Traceback"), (crash, "Traceback", "")):
        child = supervisor.start("router", ["-c", script, "sh"], program=["sh"])
        with pytest.raises(ChildFailedError) as failed:
            supervisor.wait_ready([child], timeout_s=30)
        message = str(failed.value)
        assert message.startswith("router exited with code") and shown in message
        assert not hidden or hidden not in message
    assert message.endswith("ValueError: x\n\nSegmentation fault\n")
    supervisor.stop_all(timeout_s=5)


def test_a_crash_shows_whole_lines_of_its_logs_end(tmp_path: Path) -> None:
    """The tail shown on the console begins at a line's start (the old code cut its first line
    anywhere: `t: 10 samples dropped as ...`)."""
    supervisor = Supervisor(tmp_path / "logs")
    script = "for i in $(seq 1000 1500); do echo line $i of the log; done; exit 1"
    child = supervisor.start("router", ["-c", script, "sh"], program=["sh"])
    with pytest.raises(ChildFailedError) as failed:
        supervisor.wait_ready([child], timeout_s=30)
    tail = str(failed.value).split("):\n", 1)[1].splitlines()
    assert tail[-1] == "line 1500 of the log" and len(tail) == 3000 // 21
    assert all(line.startswith("line ") and line.endswith(" of the log") for line in tail)
    supervisor.stop_all(timeout_s=5)


def test_ctrl_c_while_a_service_starts_ends_the_wait_at_once(tmp_path: Path) -> None:
    """A real model's engine may take minutes to start: Ctrl-C must not wait for it."""
    interrupted: list[bool] = []
    supervisor = Supervisor(tmp_path / "logs", interrupted)
    # A service that never becomes ready (sh ignores the --ready-file it is given).
    engine = supervisor.start("engine0", ["-c", "sleep 300", "sh"], program=["sh"])
    threading.Timer(0.5, interrupted.append, [True]).start()
    started = time.monotonic()
    with pytest.raises(StartInterruptedError, match="interrupted while engine0 was starting"):
        supervisor.wait_ready([engine], timeout_s=60)
    assert time.monotonic() - started < 5
    supervisor.stop_all(timeout_s=5)
    assert gone(engine.proc.pid)


def test_a_service_slow_to_start_is_named_with_its_logs_last_line_while_tandem_up_waits(
    tmp_path: Path,
) -> None:
    """A real model's engine may load for minutes: the wait is never silent."""
    heard: list[str] = []
    supervisor = Supervisor(tmp_path / "logs", note=heard.append, note_every_s=0.3)
    script = "echo loading; sleep 0.2; echo 'loading weights: 40%'; sleep 300"
    engine = supervisor.start("engine0", ["-c", script, "sh"], program=["sh"])
    with pytest.raises(ChildFailedError, match="engine0 was not ready after 2s"):
        supervisor.wait_ready([engine], timeout_s=2)
    assert len(heard) >= 3, heard
    assert heard[-1].startswith("engine0 is still starting (") and heard[-1].endswith(
        " s of 2, --startup-timeout-s); its log's last line: loading weights: 40%"
    )
    supervisor.stop_all(timeout_s=5)


def test_stop_all_says_who_is_slow_to_stop_and_names_who_it_had_to_kill(tmp_path: Path) -> None:
    """The trainer saves on SIGTERM: tandem up says it waits for it, and says so when the
    wait (--stop-timeout-s) ran out and it killed it."""
    supervisor = Supervisor(tmp_path / "logs")
    quick = supervisor.start("router", [], ready=False, program=["sleep", "300"])
    stubborn = supervisor.start(
        "trainer", [], ready=False, program=["sh", "-c", "trap '' TERM; sleep 300"]
    )
    time.sleep(0.3)  # sh has set its trap
    heard: list[list[str]] = []
    started = time.monotonic()
    killed = supervisor.stop_all(timeout_s=1.5, on_slow=heard.append, slow_s=0.5)
    assert 1.4 < time.monotonic() - started < 5
    assert killed == ["trainer"] and heard == [["trainer"]]
    assert quick.proc.returncode == -15 and stubborn.proc.returncode == -9


def test_a_second_ctrl_c_kills_what_still_runs_and_says_so(tmp_path: Path, capsys) -> None:
    """A second Ctrl-C while the trainer saves kills it: said as that (it was said as "did not
    stop in time (--stop-timeout-s 300, or Ctrl-C)", after a second of waiting)."""
    interrupted = [True]
    supervisor = Supervisor(tmp_path / "logs", interrupted)
    supervisor.start("trainer", [], ready=False, program=["sh", "-c", "trap '' TERM; sleep 300"])
    time.sleep(0.3)  # sh has set its trap
    threading.Timer(0.5, interrupted.append, [True]).start()
    config = SimpleNamespace(stop_timeout_s=300.0)
    run = SimpleNamespace(config=config, supervisor=supervisor, interrupted=interrupted)
    started = time.monotonic()
    UpRun.stop_services(run)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    assert (
        "[up] trainer killed (Ctrl-C again; --stop-timeout-s); its last save may be cut short"
    ) in capsys.readouterr().out


def test_the_services_named_first_have_stopped_before_the_others_are_signalled(
    tmp_path: Path,
) -> None:
    """tandem up stops the router first: it ends its groups in flight as cancelled (their
    prompts drawn again on a resume) while the engines still answer."""
    supervisor = Supervisor(tmp_path / "logs")

    def service(name: str, on_term: str) -> None:
        script = f"trap '{on_term}; date +%s.%N > {tmp_path / name}; exit 0' TERM; "
        supervisor.start(name, [], ready=False, program=["sh", "-c", script + "sleep 300 & wait"])

    service("engine0", "true")
    service("router", "sleep 1")  # ends its groups, then exits
    service("trainer", "true")
    time.sleep(0.3)  # the traps are set
    assert supervisor.stop_all(timeout_s=10, first=("router",)) == []
    router, engine, trainer = (
        float((tmp_path / n).read_text()) for n in ("router", "engine0", "trainer")
    )
    assert engine > router and trainer > router


def test_a_second_ctrl_c_while_services_stop_kills_them_at_once(tmp_path: Path) -> None:
    interrupted: list[bool] = [True]  # the Ctrl-C that began the stop
    supervisor = Supervisor(tmp_path / "logs", interrupted)
    stubborn = supervisor.start(
        "trainer", [], ready=False, program=["sh", "-c", "trap '' TERM; sleep 300"]
    )
    time.sleep(0.3)  # sh has set its trap
    threading.Timer(1.0, interrupted.append, [True]).start()
    started = time.monotonic()
    assert supervisor.stop_all(timeout_s=60) == ["trainer"]
    assert time.monotonic() - started < 5 and stubborn.proc.returncode == -9


def test_a_service_imports_tandems_packages_not_the_users_folders_of_the_same_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tandem up` run in a project with folders of its own named `proto`, `services` and
    `tandem`: `python -m` would look in the current directory first and import those."""
    for name in ("proto", "services", "tandem"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "README.md").write_text("the user's own")
    monkeypatch.chdir(tmp_path)
    supervisor = Supervisor(tmp_path / "logs")
    broker = supervisor.start("broker", ["broker", "--help"], ready=False)
    assert broker.proc.wait(timeout=60) == 0, broker.log_tail()
    assert broker.log_path.read_text().startswith("usage: tandem broker")


def test_a_service_that_exits_0_mid_run_is_said_to_be_stopped_by_a_signal(tmp_path: Path) -> None:
    """A service exits 0 only when a signal stops it (its exit-code table): it was said to have
    `exited with code 0`, nothing more, or (before they exited 0) `was killed by SIGTERM`."""
    supervisor = Supervisor(tmp_path / "logs")
    for code, said in (
        (0, "exited with code 0 (stopped by a signal tandem up did not send: kill?)"),
        (3, "exited with code 3"),
        (-9, "was killed by SIGKILL (out of memory?)"),
    ):
        script = f"kill -{-code} $$" if code < 0 else f"exit {code}"
        child = supervisor.start("router", [], ready=False, program=["sh", "-c", script])
        child.proc.wait(timeout=10)
        assert child.how_it_ended() == said, code


def test_a_second_launch_in_a_run_folder_keeps_the_earlier_launches_logs(tmp_path: Path) -> None:
    """A resume's services wrote over the logs of the launch it resumes (where what went wrong
    was said); they are kept as NAME.log.1, .2, .3, the newest first."""
    for launch in range(1, 6):
        supervisor = Supervisor(tmp_path / "logs")
        child = supervisor.start("svc", [], ready=False, program=["echo", f"launch {launch}"])
        assert child.proc.wait(timeout=10) == 0
    logs = tmp_path / "logs"
    assert (logs / "svc.log").read_text() == "launch 5\n"
    kept = [(logs / f"svc.log.{n}").read_text() for n in (1, 2, 3)]
    assert kept == ["launch 4\n", "launch 3\n", "launch 2\n"]
    assert not (logs / "svc.log.4").exists()
