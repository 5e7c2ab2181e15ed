"""An asyncio concurrency limit that can be changed while tasks wait on it."""

from __future__ import annotations

import asyncio
from types import TracebackType


class Limiter:
    """`async with limiter:` admits at most `limit` holders at once (0 = unlimited).

    Unlike `asyncio.Semaphore`, the limit can be raised or lowered at run time
    (`PATCH /rollout/config`); lowering it lets current holders finish and admits no new ones
    until the count is below the new limit.
    """

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self.holders = 0
        self._changed = asyncio.Condition()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def __aenter__(self) -> None:
        if self.limit and self.holders >= self.limit:
            async with self._changed:
                await self._changed.wait_for(lambda: not self.limit or self.holders < self.limit)
        self.holders += 1

    async def __aexit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.holders -= 1
        if self.limit:
            async with self._changed:
                self._changed.notify(1)
