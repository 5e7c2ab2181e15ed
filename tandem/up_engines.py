"""The run's engines in `tandem up`: restarted when they exit mid-run, synced at its end.

An inference engine is the service most likely to die under a long run (out of memory, a driver
fault) and the one the run can best do without for a while: the router takes it out of the
rotation and sends its requests to the others, and once it is back on the same URL it serves an
older weight version, so the router has the broker bring it to the current one before it gets
traffic again (rollout_router/workers.py). `tandem up` restarts it up to `--engine-restarts`
times in a run; past that, or when one does not come back within `--startup-timeout-s`, the run
ends naming it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import urlsplit

from redis import RedisError

from services.sample_buffer import SampleBuffer
from tandem.supervisor import Child, Supervisor


class EngineRestarts:
    """Up to `limit` restarts of engines in a run, each on its port; `check` each round."""

    def __init__(
        self, supervisor: Supervisor, limit: int, timeout_s: float, say: Callable[[str], None]
    ) -> None:
        self.supervisor, self.limit, self.timeout_s, self.say = supervisor, limit, timeout_s, say
        self.used = 0
        self.starting: dict[str, tuple[Child, float]] = {}  # name -> (child, when started)

    def restart(self, child: Child) -> bool:
        """Start `child` again if it is an engine and restarts are left (saying so); False
        when the run must end on its exit."""
        if not child.name.startswith("engine") or self.used >= self.limit:
            if child.name.startswith("engine") and self.limit:
                self.say(f"{child.name} exited after {self.used} restarts (--engine-restarts)")
            return False
        self.used += 1
        port = urlsplit(child.info["url"]).port
        others = [c for c in self.supervisor.children if c.name.startswith("engine") and c != child]
        meanwhile = (
            "the router sends its requests to the other engines meanwhile"
            if others
            else "the run waits for it (its groups in flight are dropped as engine_error)"
        )
        self.say(
            f"{child.name} {ended(child)} (log: {child.log_path}); starting it again on port "
            f"{port} (restart {self.used} of {self.limit}, --engine-restarts); {meanwhile}"
        )
        again = self.supervisor.restart(child, ["--port", str(port)])
        self.starting[child.name] = (again, time.monotonic())
        return True

    def check(self) -> str:
        """Say which restarted engines are up; why the run must end ("" if it need not): one
        that did not come up within the start-up bound."""
        for name, (child, started) in list(self.starting.items()):
            if child.ready_file is not None and child.ready_file.exists():
                del self.starting[name]
                self.say(
                    f"{name} is up again ({time.monotonic() - started:.0f} s): the router has the "
                    "broker bring it to the current weights before it gets requests"
                )
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
    lines = [line for line in child.log_tail(2000).splitlines() if line.strip()]
    return f"{child.how_it_ended()}: {lines[-1].strip()[-300:] if lines else '(empty log)'}"


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
