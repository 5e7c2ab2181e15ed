"""Shared fixtures: a real Valkey/Redis server process, the toy model, and service processes.

Service processes are started through the real CLI (`python -m tandem.cli <service> ...`) with
`--ready-file F` (tests pass `--port 0` so the OS picks the port), and killed by process group at
teardown. Every child also dies with the pytest process (PR_SET_PDEATHSIG), so even a killed test
run leaves no Redis or service behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from tandem.supervisor import die_with_parent
from tandem.toy_model import write_toy_model
from tests.fake_sglang import FakeEngineProcess

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest tests first (end-to-end runs, then those marked slow), each group in its
    files' order: the last tests the workers (`-n 2`) take are then short ones, and neither
    waits out a minutes-long test of the other's at the end."""
    items.sort(key=slowness)


def slowness(item: pytest.Item) -> int:
    """0: an end-to-end run (marked e2e), 1: marked slow, 2: the rest."""
    marks = ("e2e", "slow")
    return next((rank for rank, mark in enumerate(marks) if item.get_closest_marker(mark)), 2)


@pytest.fixture(autouse=True)
def no_leaked_run_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tandem up` code run in-process sets a per-run API token and weight secret in
    `os.environ`; none may outlive its test (every later service would then demand it)."""
    for name in ("TANDEM_API_TOKEN", "TANDEM_WEIGHT_SECRET"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])  # restored as it was after the test
        else:
            monkeypatch.setenv(name, "")  # recorded as absent: deleted after the test
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(
        log_dir=tmp_path_factory.mktemp("redis"), preexec_fn=die_with_parent
    ) as server:
        yield server


@pytest.fixture
def buffer(redis_server: RedisServer, request: pytest.FixtureRequest) -> SampleBuffer:
    """A buffer on the shared server, under a run id unique to this test."""
    run_id = request.node.name.replace("[", "_").replace("]", "_")
    buf = SampleBuffer(BufferConfig(redis_url=redis_server.url, run_id=run_id))
    for key in buf.redis.scan_iter(f"tandem:{run_id}:*"):
        buf.redis.delete(key)
    return buf


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_model(tmp_path_factory.mktemp("toy") / "model", seed=0)


class ServiceProcess:
    """A `tandem <service>` subprocess; `url` is read from its ready file."""

    def __init__(
        self,
        args: list[str],
        workdir: Path,
        name: str,
        timeout_s: float = 120.0,
        program: list[str] | None = None,
    ):
        """Run `tandem ARGS` (or `PROGRAM ARGS`) and wait for its ready file."""
        self.ready_file = workdir / f"{name}.ready.json"
        self.log_path = workdir / f"{name}.log"
        self.ready_file.unlink(missing_ok=True)
        cmd = [*(program or [sys.executable, "-m", "tandem.cli"]), *args]
        if "--ready-file" not in args:
            cmd += ["--ready-file", str(self.ready_file)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.info: dict = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{name} did not become ready:\n{self.log()[-4000:]}")

    @property
    def url(self) -> str:
        return self.info["url"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Callable[..., FakeEngineProcess]]:
    """`engines(*flags)` -> a stand-in SGLang engine process (router tests); all stopped after."""
    started: list[FakeEngineProcess] = []

    def _start(*flags: str) -> FakeEngineProcess:
        engine = FakeEngineProcess(tmp_path, f"engine{len(started)}", *flags)
        started.append(engine)
        return engine

    yield _start
    for engine in started:
        engine.stop()


@pytest.fixture
def start_service(tmp_path: Path) -> Iterator:
    """`start_service(name, args)` -> ServiceProcess; all are stopped after the test.
    Pass `--port 0` in `args` for HTTP services: nothing picks a port for you."""
    started: list[ServiceProcess] = []

    def _start(
        name: str, args: list[str], timeout_s: float = 120.0, program: list[str] | None = None
    ) -> ServiceProcess:
        service = ServiceProcess(args, tmp_path, name, timeout_s, program)
        started.append(service)
        return service

    yield _start
    for service in reversed(started):
        service.stop()
