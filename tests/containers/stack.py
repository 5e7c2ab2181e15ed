"""One CPU stack (compose.cpu.yaml) under its own compose project, driven by docker-compose.

Every published port is chosen free on 127.0.0.1 and the stack is reached only there; the
containers reach each other by service name on the network compose makes for the project.
`remove` takes down its containers, network and volumes and says what is left (nothing, or the
test fails). Every call is bounded in time.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from tests.containers.docker_host import ROOT, say

FILE = ROOT / "compose.cpu.yaml"
PORTS = ("ROUTER_PORT", "BROKER_PORT", "VALKEY_PORT", "ENGINE_0_PORT", "ENGINE_1_PORT")
RUN_ID = "ct"


def free_port() -> int:
    """A free port on 127.0.0.1 below the kernel's ephemeral range (32768 and up), which the
    machine's own outgoing connections and port-0 servers draw from: a port picked there can
    be taken again before the stack binds it."""
    while True:
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class Stack:
    def __init__(self, name: str, **settings: str) -> None:
        self.project = f"tandemct{os.getpid()}{name}"
        self.env = {
            **os.environ,
            "COMPOSE_PROJECT_NAME": self.project,
            "TANDEM_API_TOKEN": secrets.token_hex(16),
            "TANDEM_WEIGHT_SECRET": secrets.token_hex(16),
            "TANDEM_REDIS_PASSWORD": secrets.token_hex(16),
            "TANDEM_RUN_ID": RUN_ID,
            **{port: str(free_port()) for port in PORTS},
            **settings,
        }

    def compose(self, *args: str, timeout_s: float = 300, check: bool = True) -> str:
        cmd = ["docker-compose", "-f", str(FILE), *args]
        try:
            done = subprocess.run(
                cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{' '.join(cmd[3:])} took over {timeout_s:.0f} s") from exc
        if check and done.returncode:
            raise AssertionError(
                f"{' '.join(cmd[3:])} exited {done.returncode}:\n{done.stderr[-3000:]}"
            )
        return done.stdout + done.stderr

    def port(self, name: str) -> int:
        return int(self.env[name])

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service, timeout_s=60).strip()
        assert cid, f"no container of {service} in {self.project}"
        return cid

    def inspect(self, service: str) -> dict[str, Any]:
        out = subprocess.run(
            ["docker", "inspect", self.container(service)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return dict(json.loads(out)[0])

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, timeout_s=120, check=False)

    def kill_9(self, service: str) -> int:
        """SIGKILL to the container's main process from the host, as a crash (a `docker kill`
        counts as a stop by hand, which no restart policy answers). Returns the container's
        restart count before it."""
        found = self.inspect(service)
        state, restarts = found["State"], int(found["RestartCount"])
        pid = int(state["Pid"])
        assert state["Running"] and pid > 0, f"{service} is not running: {state}"
        os.kill(pid, 9)
        say(f"kill -9 {service} (host pid {pid})")
        return restarts

    @property
    def password(self) -> str:
        return self.env["TANDEM_REDIS_PASSWORD"]

    def redis(self, password: str | None = None) -> redis.Redis:
        """A client of the stack's Valkey through its published port (with its password unless
        another is given; "" sends none)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port("VALKEY_PORT"),
            password=self.password if password is None else (password or None),
            socket_timeout=10,
        )

    def tandem(self, *args: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
        """`tandem ARGS` on the host against the stack's Valkey (its URL carries no password:
        TANDEM_REDIS_PASSWORD, the stack's unless another is given, "" none)."""
        url = f"redis://127.0.0.1:{self.port('VALKEY_PORT')}/0"
        env = {k: v for k, v in os.environ.items() if k != "TANDEM_REDIS_PASSWORD"}
        if (given := self.password if password is None else password) != "":
            env["TANDEM_REDIS_PASSWORD"] = given
        return subprocess.run(
            [sys.executable, "-m", "tandem.cli", *args, "--redis-url", url, "--run-id", RUN_ID],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=env,
        )

    def version(self) -> int:
        raw = self.redis().get(f"tandem:{RUN_ID}:version:trainer")
        return int(raw) if raw is not None else -1

    def at_version(self, least: int) -> Callable[[], int | None]:
        """For `wait_for`: the trainer's version once it is `least` or more (as version + 1, so
        that version 0 counts as reached)."""
        return lambda: v + 1 if (v := self.version()) >= least else None

    def restarted(self, service: str, before: int) -> Callable[[], bool]:
        """For `wait_for`: the service restarted (by its policy) since `before` and runs."""

        def check() -> bool:
            state = self.inspect(service)
            return bool(state["RestartCount"] > before and state["State"]["Running"])

        return check

    def counter(self, name: str) -> int:
        raw = self.redis().hget(f"tandem:{RUN_ID}:counters", name)
        return int(raw) if raw is not None else 0

    def wait_for(self, what: str, test: Any, timeout_s: float) -> Any:
        """Poll `test()` until it gives something true; a failure names `what` and the logs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if found := test():
                    return found
            except (redis.RedisError, AssertionError, OSError):
                pass
            time.sleep(1)
        raise AssertionError(
            f"{what}: not within {timeout_s:.0f} s\n{self.logs('trainer')[-4000:]}"
        )

    def wait_exit(self, service: str, timeout_s: float) -> int:
        """The exit code of `service` once it has exited (restarts included: the last one)."""

        def exited() -> int | None:
            state = self.inspect(service)["State"]
            restarting = state["Restarting"] or state["Running"]
            return None if restarting else int(state["ExitCode"]) + 1000

        return int(self.wait_for(f"{service} exits", exited, timeout_s)) - 1000

    def ledger(self) -> str:
        """`tandem ledger` of the run, read from its Valkey; fails unless balanced."""
        done = self.tandem("ledger")
        say(f"ledger of {self.project}:\n{done.stdout}")
        assert done.returncode == 0, (
            f"ledger not balanced ({done.returncode}):\n{done.stdout}{done.stderr}"
        )
        return done.stdout

    def metrics(self) -> list[dict[str, Any]]:
        """The run's metrics records (`tandem metrics --json`), read from its Valkey."""
        done = self.tandem("metrics", "--json")
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]

    def lineage(self) -> dict[int, list[str]]:
        raw = self.redis().hgetall(f"tandem:{RUN_ID}:trained")
        return {int(step): json.loads(ids) for step, ids in raw.items()}

    def remove(self) -> list[str]:
        """Down with volumes; what is left of the project (empty when all is gone)."""
        self.compose(
            "down", "-v", "--remove-orphans", "--timeout", "30", timeout_s=300, check=False
        )
        left = []
        label = f"label=com.docker.compose.project={self.project}"
        for kind in ("container", "network", "volume"):
            cmd = ["docker", kind, "ls", "-q", "--filter", label]
            if kind == "container":
                cmd.insert(3, "-a")
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.split()
            left += [f"{kind} {name}" for name in out]
        return left
