"""The fault suite: the services of one run started separately (as compose runs them), each
killed with SIGKILL mid-run in turn and started again the same way, the run going on after each.

One run, one tour (starting a trainer costs more than a fault): engine, router, broker, Redis
(AOF in its data folder) and trainer (resumes from its --save checkpoint) are killed in that
order; after each restart the run must train `STEPS_AFTER` more steps within `PHASE_S`. At the
end no group id was trained twice, the ledger balances (generated = trained + dropped +
buffered + in flight) and the trainer never saw it unbalanced. The ledger of each phase is
printed.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections import Counter
from pathlib import Path

import pytest
from redis.exceptions import RedisError

from services.sample_buffer import BufferConfig, SampleBuffer
from services.sample_buffer.server import RedisServer
from tandem.up_services import run_values, service_args
from tandem.up_tree import child_file, compose, wired
from tests.conftest import ServiceProcess

PHASE_S = 120.0
STEPS_AFTER = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Run:
    """The processes of one run, each restartable with its first command line."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root = root
        self.redis = RedisServer(port=free_port(), data_dir=root / "redis").start()
        tree = compose(["--max-steps", "10000", "--save-interval", "2"])
        run = run_values(tree, "tour", model, self.redis.url, root)
        configs, _ = wired(tree, run)  # each service's file, as tandem up writes it
        self.args = service_args({n: child_file(configs, n, root) for n in configs}, run)
        engine_port, broker_port, intake = free_port(), free_port(), free_port()
        engine_url = f"http://127.0.0.1:{engine_port}"
        broker_url = f"http://127.0.0.1:{broker_port}"
        self.args["engine"] = [*self.args["engine"], "--port", str(engine_port)]
        self.args["broker"] = [
            *self.args["broker"],
            "--port",
            str(broker_port),
            "--intake-endpoint",
            f"tcp://127.0.0.1:{intake}",
            "--engine-urls",
            engine_url,
        ]
        self.args["router"] = [
            *self.args["router"],
            "--engine-urls",
            engine_url,
            "--broker-url",
            broker_url,
        ]
        self.args["trainer"] = [
            *self.args["trainer"],
            "--weights-endpoint",
            f"tcp://127.0.0.1:{intake}",
        ]
        self.procs: dict[str, ServiceProcess] = {}
        self.pids: list[int] = []  # every process started, killed ones included
        self.buffer = SampleBuffer(BufferConfig(redis_url=self.redis.url, run_id="tour"))
        for name in ("engine", "broker", "router", "trainer"):
            self.start(name)

    def start(self, name: str) -> None:
        self.procs[name] = ServiceProcess(self.args[name], self.root, name, timeout_s=PHASE_S)
        self.pids.append(self.procs[name].proc.pid)

    def kill(self, name: str) -> None:
        if name == "redis":
            assert self.redis.process is not None
            self.redis.process.kill()
            self.redis.process.wait()
            return
        proc = self.procs[name].proc
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def restart_redis(self) -> None:
        self.redis = RedisServer(port=self.redis.port, data_dir=self.root / "redis").start()

    def steps(self) -> int:
        try:
            return len(self.buffer.trained())
        except RedisError:  # during the Redis phase
            return -1

    def wait_steps(self, at_least: int, phase: str) -> int:
        deadline = time.monotonic() + PHASE_S
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.proc.poll() is not None:
                    pytest.fail(
                        f"{phase}: {name} exited {proc.proc.returncode}:\n{proc.log()[-3000:]}"
                    )
            if (steps := self.steps()) >= at_least:
                return steps
            time.sleep(0.5)
        logs = "\n".join(f"--- {n}\n{p.log()[-1500:]}" for n, p in self.procs.items())
        waits = "\n".join(f"{r}: {s.state}: {s.waiting_for}" for r, s in self.statuses().items())
        pytest.fail(f"{phase}: fewer than {at_least} steps after {PHASE_S:.0f} s\n{waits}\n{logs}")

    def statuses(self) -> dict:
        try:
            return self.buffer.statuses()
        except RedisError:
            return {}

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        self.redis.stop()
        for pid in self.pids:  # a killed trainer cannot remove its shared-memory weight slots
            for slot in Path("/dev/shm").glob(f"tandem-weights-{pid}-*"):
                slot.unlink(missing_ok=True)


@pytest.mark.slow
def test_each_service_killed_mid_run_and_restarted_the_run_goes_on_and_nothing_is_lost(
    tmp_path: Path, toy_model_dir: Path
) -> None:
    run = Run(tmp_path, toy_model_dir)
    try:
        steps = run.wait_steps(3, "start")
        for name in ("engine", "router", "broker", "redis", "trainer"):
            started = time.monotonic()
            run.kill(name)
            time.sleep(1.0)
            run.restart_redis() if name == "redis" else run.start(name)
            steps = run.wait_steps(steps + STEPS_AFTER, f"after killing the {name}")
            took = f"{time.monotonic() - started:.0f} s"
            print(
                f"{name} killed and restarted: {steps} steps in {took}; {run.buffer.ledger().sentence()}"
            )
        trained = [gid for ids in run.buffer.trained().values() for gid in ids]
        twice = [gid for gid, n in Counter(trained).items() if n > 1]
        assert not twice, f"groups trained twice: {twice[:10]}"
        ledger = run.buffer.ledger()
        assert ledger.balanced, ledger.sentence()
        assert run.buffer.counters().get("ledger_violations", 0) == 0
    finally:
        run.stop()
