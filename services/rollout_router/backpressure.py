"""The buffer's depth bound, one rule for every producer of the router: the rollout loop's
groups and agent sessions' rewards.

The backlog is `groups_put - groups_consumed` (sample_buffer/keys.py): groups in the buffer that
the trainer has yet to train or drop. At `--max-buffer-depth` producers wait: the rollout loop
starts no group (rollout.py) and a group that is complete waits to be put; a reward post that
would put a group waits up to `--session-put-timeout-s`, then is answered 503 with Retry-After
and its session is kept, so the agent posts again and nothing is lost.

Puts take turns (one asyncio lock): a producer holds the turn from the backlog read that found
room to the end of its XADD, so the bound is exact for this router (one router per run). The
turn is taken in arrival order; a waiter is unblocked by the trainer counting groups consumed.

Consistency with the demand gate (progress.py): the gate lets rollouts run up to
`staleness_reach()` groups ahead of the trainer; the depth bound must leave room for the
trainer's whole rollout (>= rollout_batch_size, checked at start-up), or the trainer would wait
for groups that wait for the trainer. Below `staleness_reach()` it, not staleness, is what
stops the rollout; `depth_note` says so at start-up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from services.rollout_router.config import RolloutConfig
from services.sample_buffer import AsyncSampleBuffer
from services.sample_buffer.keys import full_error, full_sentence


def depth_note(config: RolloutConfig) -> str:
    """A start-up line when the depth bound, not staleness, limits how far rollouts run ahead."""
    bound, reach = config.buffer_depth_bound(), config.staleness_reach()
    if not config.rollout or bound == 0 or bound >= reach:
        return ""
    return (
        f"--max-buffer-depth {bound} holds rollouts to {bound} groups ahead of the trainer, "
        f"fewer than --max-staleness {config.max_staleness} allows ({reach}); raise "
        f"--max-buffer-depth to {reach} to let them run as far ahead as staleness allows"
    )


class BufferBound:
    """Turns at putting groups, each taken only while the backlog is below `max_depth`."""

    def __init__(self, buffer: AsyncSampleBuffer, max_depth: int) -> None:
        self.buffer, self.max_depth = buffer, max_depth
        self.waiting = 0  # producers waiting for a turn
        self._turn = asyncio.Lock()

    def sentence(self, depth: int) -> str:
        """`waiting` of the status: why producers wait ("" when they do not)."""
        if self.max_depth and depth >= self.max_depth:
            return full_sentence(depth, self.max_depth)
        return ""

    @asynccontextmanager
    async def turn(
        self, timeout_s: float | None, on_full: Callable[[str], None] | None = None
    ) -> AsyncIterator[int]:
        """Hold the put turn once the backlog (yielded) is below the bound; `on_full` hears
        the sentence while it is not. `BufferFullError` after `timeout_s` (None: never)."""
        started = time.monotonic()
        self.waiting += 1
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._turn.acquire()
            except TimeoutError:
                depth = await self.buffer.backlog()
                error = full_error(self.buffer.samples_key, depth, self.max_depth, timeout_s or 0)
                raise error from None
            left = None if timeout_s is None else timeout_s - (time.monotonic() - started)
            heard = None if on_full is None else (lambda depth: on_full(self.sentence(depth)))
            try:
                depth = await self.buffer.wait_for_room(self.max_depth, left, heard)
            except BaseException:
                self._turn.release()
                raise
        finally:
            self.waiting -= 1
        try:
            yield depth
        finally:
            self._turn.release()
