"""The rollout loop's progress rules, as plain arithmetic: the demand gate, the prompt cursor's
order, and the backoff after a dependency fails. No I/O but `read_demand`, which reads the
gate's numbers from Redis for the loop (`loop.py`).

Demand gate. B = rollout_batch_size, k = num_steps_per_rollout, s = max_staleness, v = the
trainer's version (optimizer steps done), e = the engines' version. The trainer fills rollout
r_t = v // k next. Groups put and not yet consumed by the trainer (trained or dropped), plus
groups in flight, are `ahead`: a new group lands in rollout r = r_t + ahead // B, which the
trainer checks for staleness at version r * k, so the group may start only if r * k <= e + s.
Every drop (the router's: never put; the trainer's: counted as consumed) lowers `ahead` and
reopens the gate, so replacements are made until the trainer has its batch. Liveness needs only
the engines to stay within s versions of the trainer, which is the broker's job.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from proto.run_terms import RunTerms
from services.rollout_router.balancer.workers import WorkerPool
from services.sample_buffer import AsyncSampleBuffer

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


@dataclass(frozen=True)
class Demand:
    """One reading of the counters behind the gate."""

    put: int
    consumed: int
    in_flight: int
    trainer_version: int
    engines_version: int

    def backlog(self) -> int:
        """Groups put and not yet consumed (never below 0: a trainer resumed on a fresh Redis
        may count more consumed than were put)."""
        return max(self.put - self.consumed, 0)

    def ahead(self) -> int:
        """Groups the trainer has yet to consume, in flight included."""
        return self.backlog() + self.in_flight


def allowance(d: Demand, batch: int, steps_per_rollout: int, max_staleness: int) -> int:
    """How many more groups may start now (0 = the gate is closed)."""
    rollout_next = max(d.trainer_version, 0) // steps_per_rollout
    last_rollout = (d.engines_version + max_staleness) // steps_per_rollout
    if d.engines_version + max_staleness < 0:
        return 0
    return max(0, (last_rollout - rollout_next + 1) * batch - d.ahead())


def needed_engines_version(d: Demand, batch: int, steps_per_rollout: int, staleness: int) -> int:
    """The engines' version at which the next group may start."""
    rollout = max(d.trainer_version, 0) // steps_per_rollout + d.ahead() // batch
    return rollout * steps_per_rollout - staleness


def closed_gate_reason(d: Demand, batch: int, steps_per_rollout: int, staleness: int) -> str:
    """What a closed gate waits for, as a sentence a user can act on."""
    if d.engines_version < max(d.trainer_version, 0):
        needed = needed_engines_version(d, batch, steps_per_rollout, staleness)
        return (
            f"engines on weight version >= {needed} (they serve {d.engines_version}); "
            "the broker brings them there: see its /state"
        )
    # (a trainer started on another run, or another Redis, waits for samples meanwhile)
    absent = (
        "; no trainer has started on this run yet (one still loading its model, or one with "
        "another --run-id or --redis-url)"
        if d.trainer_version < 0
        else ""
    )
    return (
        f"the trainer to consume groups (put {d.put}, consumed {d.consumed}, "
        f"trainer at version {d.trainer_version}){absent}"
    )


def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch `epoch` visits the `size` training prompts."""
    return random.Random(f"{seed}:epoch:{epoch}").sample(range(size), size)


class EpochOrders:
    """`epoch_order` of the current epoch, computed once per epoch (and per train set size)."""

    def __init__(self) -> None:
        self.key: tuple[int, int, int] = (-1, -1, -1)
        self.value: list[int] = []

    def order(self, size: int, seed: int, epoch: int) -> list[int]:
        if self.key != (size, seed, epoch):
            self.key, self.value = (size, seed, epoch), epoch_order(size, seed, epoch)
        return self.value


class Backoff:
    """Waits after groups keep failing for a dependency (engines, environment, reward service).

    A failure of a group started after the last failure was noted doubles the wait (0.5 s up
    to 30 s); failures of groups that were already in flight do not, so one wave of failures
    counts once. While backing off, the loop starts one group at a time (a probe). The first
    group put resets it."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.until = 0.0  # monotonic time before which no group starts
        self.noted_at = 0.0
        self.streak = 0
        self.reason = ""
        self.detail = ""

    @property
    def active(self) -> bool:
        return self.delay_s > 0

    def failed(self, reason: str, detail: str, started_at: float, now: float) -> None:
        self.streak = self.streak + 1 if reason == self.reason else 1
        self.reason, self.detail = reason, detail
        if started_at >= self.noted_at:
            self.delay_s = min(max(self.delay_s * 2, BACKOFF_FIRST_S), BACKOFF_MAX_S)
            self.until, self.noted_at = now + self.delay_s, now

    def sentence(self, what: str, left_s: float) -> str:
        """The wait as the status says it (`left_s` <= 0: the probe group is in flight)."""
        after = f"next try in {left_s:.0f} s" if left_s > 0 else "one group is trying it now"
        return f"{what}: {self.streak} {self.reason} in a row ({self.detail[:200]}), {after}"

    def succeeded(self) -> None:
        self.delay_s, self.until, self.streak, self.reason = 0.0, 0.0, 0, ""


async def engines_version(buffer: AsyncSampleBuffer, pool: WorkerPool) -> int:
    """max(`version:engines` in Redis, the lowest version an admitted engine reported)."""
    return max(await buffer.get_version("engines"), pool.min_version())


async def read_demand(
    buffer: AsyncSampleBuffer, run: RunTerms, in_flight: int, engines_version: int
) -> Demand:
    """The gate's inputs from Redis."""
    counters = await buffer.counters()
    trainer = await buffer.get_version("trainer")
    # A trainer that does not count `groups_consumed` (an older one) has consumed exactly
    # one rollout_batch_size per rollout it finished: the gate is then the old batch gate.
    rollouts_done = max(trainer, 0) // run.num_steps_per_rollout
    return Demand(
        put=counters.get("groups_put", 0),
        consumed=counters.get("groups_consumed", rollouts_done * run.rollout_batch_size),
        in_flight=in_flight,
        trainer_version=trainer,
        engines_version=engines_version,
    )
