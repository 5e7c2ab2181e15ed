"""The run's engines, router and broker in `tandem up`: restarted when they exit mid-run; the
engines synced at its end.

An inference engine is the service most likely to die under a long run (out of memory, a driver
fault) and the one the run can best do without for a while: the router takes it out of the
rotation and sends its requests to the others, and once it is back on the same URL it serves an
older weight version, so the router has the broker bring it to the current one before it gets
traffic again (rollout_router/balancer/workers.py). The router holds the most in memory (the dataset,
agent sessions); while it is down the trainer trains on what is buffered, and a router started
again on its port drops the groups the dead one left in flight (`cancelled`) and draws their
prompts again (sample_buffer/ledger.py), the agent sessions open in it lost. The broker holds
no weights the run needs (zmq transport): while it is down the engines serve what they hold and
the trainer's sends wait (up to 120 s); started again on its port and weight intake,
it asks the trainer for its latest version when the engines are behind (`version:resend`);
on the same serve endpoint too, so that an engine's fetch begun as the old one died is
answered by the new one instead of waiting out its timeout.
Under NCCL its process groups with the trainer and engines end with it: never restarted.
`tandem up` restarts each kind up to `--engine-restarts` / `--router-restarts` /
`--broker-restarts` times in a run; past that, or when one does not come back within
`--startup-timeout-s`, the run ends naming it; one that exited 2 (its configuration refused, as
a dataset row read late) is not restarted: the run ends with exit 2.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from redis import RedisError

from services.sample_buffer import SampleBuffer
from tandem.supervisor import Child, Supervisor
from tandem.watchdog import Watchdog


class Restarts:
    """Up to `limits[kind]` restarts of the engines, the router and the broker ("engine",
    "router", "broker") in a run, each on its port; `check` each round. A restarting service
    is out of the watchdog's health checks until it is up."""

    def __init__(
        self,
        supervisor: Supervisor,
        limits: dict[str, int],
        timeout_s: float,
        say: Callable[[str], None],
        watchdog: Watchdog,
    ) -> None:
        self.supervisor, self.limits, self.timeout_s, self.say = supervisor, limits, timeout_s, say
        self.watchdog = watchdog
        self.used = dict.fromkeys(limits, 0)
        self.starting: dict[str, tuple[Child, float]] = {}  # name -> (child, when started)
        self.unwatched: dict[str, str] = {}  # name -> its health URL, while it starts again

    def restart(self, child: Child) -> bool:
        """Start `child` again if it is an engine, the router or the broker and restarts are
        left (saying so); False when the run must end on its exit."""
        kind = next((k for k in self.limits if child.name.startswith(k)), "")
        if child.proc.returncode == 2:  # (its configuration refused: a restart would repeat it)
            return False
        if not kind or self.used[kind] >= self.limits[kind]:
            if kind and self.limits[kind]:
                self.say(
                    f"{child.name} exited after {self.used[kind]} restarts (--{kind}-restarts)"
                )
            return False
        self.used[kind] += 1
        port = urlsplit(child.info["url"]).port
        self.say(
            f"{child.name} {ended(child)} (log: {child.log_path}); starting it again on port "
            f"{port} (restart {self.used[kind]} of {self.limits[kind]}, --{kind}-restarts); "
            f"{self.meanwhile(child)}"
        )
        if child.name in self.watchdog.health_urls:
            self.unwatched[child.name] = self.watchdog.health_urls.pop(child.name)
        same = ["--port", str(port)]
        if kind == "broker":  # where the trainer sends weights and engines fetch them (an
            # engine's fetch begun as the old one died then reaches the new one, not a timeout)
            same += ["--intake-endpoint", child.info["intake_endpoint"]]
            same += ["--serve-endpoint", child.info["serve_endpoint"]]
        if kind in ("router", "broker"):  # its lease is given up: the new one need not wait
            with contextlib.suppress(RedisError):  # (it expires by itself within seconds)
                self.watchdog.buffer.release_lease_of(kind, child.proc.pid)
        again = self.supervisor.restart(child, same)
        self.starting[child.name] = (again, time.monotonic())
        return True

    def meanwhile(self, child: Child) -> str:
        """What the run does without `child`."""
        if child.name == "router":
            return (
                "the trainer trains on what is buffered meanwhile; the groups it had in flight "
                "are dropped as cancelled and drawn again, its open agent sessions are lost"
            )
        if child.name == "broker":
            return "the engines serve the weights they hold meanwhile"
        if any(c.name.startswith("engine") and c != child for c in self.supervisor.children):
            return "the router sends its requests to the other engines meanwhile"
        return (
            "the run waits for it (its groups in flight are dropped as engine_error and drawn "
            "again)"
        )

    def check(self) -> str:
        """Say which restarted services are up; why the run must end ("" if it need not): one
        that did not come up within the start-up bound."""
        for name, (child, started) in list(self.starting.items()):
            if child.ready_file is not None and child.ready_file.exists():
                del self.starting[name]
                if name in self.unwatched:
                    self.watchdog.health_urls[name] = self.unwatched.pop(name)
                    self.watchdog.failures[name] = 0
                up = f"{name} is up again ({time.monotonic() - started:.0f} s)"
                if name.startswith("engine"):
                    up += ": the router has the broker bring it to the current weights first"
                self.say(up)
            elif time.monotonic() - started > self.timeout_s:
                return (
                    f"{name} was restarted and not ready after {self.timeout_s:.0f} s "
                    f"(--startup-timeout-s; log: {child.log_path}):\n{child.log_tail()}"
                )
        return ""


def ended(child: Child) -> str:
    """How `child` ended, with its log's last line when it exited on its own."""
    if child.proc.returncode < 0:
        return child.how_it_ended()
    return f"{child.how_it_ended()}: {child.last_line(2000)[-300:] or '(empty log)'}"


def wait_engines_synced(
    buffer: SampleBuffer, say: Callable[[str], None], timeout_s: float = 30.0
) -> None:
    """After the trainer's last step, let the broker bring the engines to its last version."""
    deadline = time.monotonic() + timeout_s
    try:
        final = buffer.get_version("trainer")
        while buffer.get_version("engines") < final:
            if time.monotonic() > deadline:
                say(f"engines did not reach the final version {final} within {timeout_s:.0f}s")
                return
            time.sleep(0.1)
    except RedisError as exc:
        say(f"cannot tell whether the engines reached the final version: Redis: {exc}")
