"""The buffer's depth bound, one rule for every producer of the router (the rollout loop's
groups, agent sessions' rewards), and the router's one way of putting groups.

The backlog is `groups_put - groups_consumed` (sample_buffer/keys.py): groups in the buffer that
the trainer has yet to train or drop. A producer first takes a slot (`slot()`), waiting while
the backlog is at `--max-buffer-depth`: the rollout loop as long as it takes (its status says
`waiting_for_buffer`); a reward post up to `--session-put-timeout-s`, then it is answered 503
with Retry-After and its session is kept, so the agent posts again and nothing is lost. Slots
are handed out in arrival order and the bound is exact for this router (one router per run):
the free room is learned from each write's reply (the backlog after it) and read from Redis
only when the slots known free run out, and a slot is taken before its group is written, so a
read never misses a group on its way.

Writes are group commits: a group put while another write is under way joins the next batch,
one ledger PUT script call writing the batch as one stream entry (or a few: ledger.py), so puts
from many tasks cost one round trip, one XADD and one trainer read per batch, not per group.
Up to PUTS_IN_FLIGHT batches are under way at once: while the server runs one, the producers
whose groups the last one wrote make their next ones (with one, the router's CPU and the
server's alternated, each idle while the other worked).

Consistency with the demand gate (rollout/progress.py): the gate lets rollouts run up to
`staleness_reach()` groups ahead of the trainer; the depth bound must leave room for the
trainer's whole rollout (>= rollout_batch_size, checked at start-up), or the trainer would wait
for groups that wait for the trainer. Below `staleness_reach()` it, not staleness, is what
stops the rollout; `depth_note` says so at start-up.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proto.packed import Group, PackedGroup, pack
from services.rollout_router.config import RouterConfig
from services.sample_buffer import AsyncSampleBuffer

UNBOUNDED = 1 << 62
# How often a producer waiting for room reads the counters (one HGETALL): soon after a read that
# found room (the trainer is consuming: room comes in a few ms), then twice as long after each
# read that found none, up to the longest (the trainer is training: room comes in seconds).
PUT_POLL_S = 0.001
PUT_POLL_MAX_S = 0.01
# PUT script calls under way at once, each on a connection of its own (the server runs each
# atomically, in the order it reads them: two halves of a turn may land in either order). Two
# overlap the router's work with the server's; more cut the batches smaller for no more overlap.
# A queue under SPLIT_MIN groups goes whole: each PUT costs the router CPU of its own (the call,
# the send, the reply), not worth it for halves of a small batch.
PUTS_IN_FLIGHT = 2
SPLIT_MIN = 16


@dataclass(eq=False)
class Waiter:
    """A producer in line for a slot (`slot` is set once the slot is taken for it)."""

    slot: asyncio.Future[None]
    on_full: Callable[[str], None] | None


class BufferFullError(RuntimeError):
    """The buffer stayed at its bound for longer than the producer's timeout."""


def full_sentence(depth: int, max_depth: int) -> str:
    """What a producer at the bound waits for (the status's `waiting`)."""
    return f"buffer full (depth {depth} of {max_depth})"


def room_sentence(depth: int, max_depth: int) -> str:
    """`waiting` of the status: why producers wait ("" when they do not)."""
    return full_sentence(depth, max_depth) if max_depth and depth >= max_depth else ""


def waiting_for_room(sentence: str) -> str:
    """A producer's `waiting_for` while the buffer is full."""
    return (
        f"{sentence}: the trainer to consume groups (--max-buffer-depth bounds the groups put "
        "and not yet consumed)"
    )


def full_error(key: str, depth: int, max_depth: int, timeout_s: float) -> BufferFullError:
    return BufferFullError(
        f"{full_sentence(depth, max_depth)} for {timeout_s:.0f}s: {key} holds groups put and "
        "not yet consumed; is the trainer running? (raise --max-buffer-depth to buffer more)"
    )


def depth_note(config: RouterConfig) -> str:
    """A start-up line when the depth bound, not staleness, limits how far rollouts run ahead."""
    bound, reach = config.buffer_depth_bound(), config.staleness_reach()
    if not config.rollout.rollout or bound == 0 or bound >= reach:
        return ""
    return (
        f"--max-buffer-depth {bound} holds rollouts to {bound} groups ahead of the trainer, "
        f"fewer than --max-staleness {config.run.max_staleness} allows ({reach}); raise "
        f"--max-buffer-depth to {reach} to let them run as far ahead as staleness allows"
    )


class Slot:
    """One group's room under a `BufferBound` (a class, not a generator: it is taken for
    every group the router puts)."""

    __slots__ = ("bound", "on_full", "timeout_s", "used")

    def __init__(
        self, bound: BufferBound, timeout_s: float | None, on_full: Callable[[str], None] | None
    ) -> None:
        self.bound, self.timeout_s, self.on_full, self.used = bound, timeout_s, on_full, False

    async def __aenter__(self) -> Callable[[Group], Awaitable[str]]:
        await self.bound._take(self.timeout_s, self.on_full)
        return self.put

    def put(self, group: Group) -> Awaitable[str]:
        self.used = True
        return self.bound._write(group)

    async def __aexit__(self, *_exc: object) -> None:
        if not self.used:
            self.bound._give_back()


class BufferBound:
    """Slots for groups under the depth bound, and the writer that puts them.

    A producer that finds no room known free joins the line; one task (`_grant`) reads the
    free room while anyone is in line and lets the head of the line go, as many producers at
    once as there is room for, so that they put their groups in one turn of the event loop
    (one batch for the writer)."""

    def __init__(
        self, buffer: AsyncSampleBuffer, max_depth: int, puts_in_flight: int = PUTS_IN_FLIGHT
    ) -> None:
        self.buffer, self.max_depth, self.puts_in_flight = buffer, max_depth, puts_in_flight
        self._room = 0  # slots known free: max_depth - backlog read - slots taken since
        self._unwritten = 0  # slots taken whose group is not yet in the counters
        self._granted = 0  # slots taken so far (a read of the room subtracts those taken since)
        # Producers waiting for a slot, in arrival order: a future set when its slot is taken,
        # and who hears that the buffer is full. At most one per producer task.
        self._line: deque[Waiter] = deque()
        self._granter: asyncio.Task | None = None
        self._queue: list[tuple[PackedGroup, asyncio.Future[str]]] = []
        self._writers: list[asyncio.Task] = []  # at most `puts_in_flight` not done

    @property
    def waiting(self) -> int:
        """Producers waiting for a slot."""
        return len(self._line)

    def sentence(self, depth: int) -> str:
        """`waiting` of the status: why producers wait ("" when they do not)."""
        return room_sentence(depth, self.max_depth)

    def slot(self, timeout_s: float | None, on_full: Callable[[str], None] | None = None) -> Slot:
        """Room for one group, waiting while the buffer is full (`on_full` hears why):
        `async with bound.slot(...) as put`, then `await put(group)` -> its stream id. A slot
        left unused is given back. `BufferFullError` after `timeout_s` (None: never)."""
        return Slot(self, timeout_s, on_full)

    def _give_back(self) -> None:
        self._room += 1
        self._unwritten -= 1

    async def _take(self, timeout_s: float | None, on_full: Callable[[str], None] | None) -> None:
        if self._room > 0 and not self._line:  # room known and nobody before this producer
            self._room -= 1
            self._unwritten += 1
            self._granted += 1
            return
        waiter = Waiter(asyncio.get_running_loop().create_future(), on_full)
        self._line.append(waiter)
        if self._granter is None or self._granter.done():
            self._granter = asyncio.create_task(self._grant(), name="buffer slots")
        try:
            async with asyncio.timeout(timeout_s):
                await waiter.slot
        except TimeoutError:
            self._leave(waiter)
            depth = self.max_depth - await self._free()
            error = full_error(self.buffer.samples_key, depth, self.max_depth, timeout_s or 0)
            raise error from None
        except BaseException:
            self._leave(waiter)
            raise

    def _leave(self, waiter: Waiter) -> None:
        """A producer gave up waiting (timeout, cancel): out of the line, or its slot given
        back when it was let go in the same turn."""
        if waiter in self._line:
            self._line.remove(waiter)
        elif waiter.slot.done() and not waiter.slot.cancelled() and not waiter.slot.exception():
            self._give_back()

    async def _grant(self) -> None:
        """While anyone is in line: read the free room (after PUT_POLL_S, doubling up to
        PUT_POLL_MAX_S while none comes; at once after room came) and let that many go, head
        first. A failed read (Redis down) fails the head's take, as it would have its own."""
        poll_s = PUT_POLL_S
        try:
            while self._line:
                try:
                    if self._room <= 0:  # (slots the writer let go during the read are not in
                        # it: taken after its count of unwritten ones, not yet in the counters)
                        granted = self._granted
                        free = await self._free()
                        self._room = max(self._room, free - (self._granted - granted))
                except Exception as exc:
                    head = self._line.popleft().slot
                    if not head.done():
                        head.set_exception(exc)
                    continue
                if self._let_go() or not self._line:
                    poll_s = PUT_POLL_S
                    continue
                if self._line[0].on_full is not None:
                    self._line[0].on_full(
                        room_sentence(self.max_depth - self._room, self.max_depth)
                    )
                await asyncio.sleep(poll_s)
                poll_s = min(poll_s * 2, PUT_POLL_MAX_S)
        finally:  # cancelled (the loop is closing): nobody is left waiting for nothing
            while self._line:
                self._line.popleft().slot.cancel()

    def _let_go(self) -> int:
        """Let as many of the line go, head first, as there is room known free; how many."""
        let_go = 0
        while self._room > 0 and self._line:
            waiter = self._line.popleft()
            if waiter.slot.done():  # cancelled: its producer is on its way out
                continue
            self._room -= 1
            self._unwritten += 1
            self._granted += 1
            waiter.slot.set_result(None)
            let_go += 1
        return let_go

    async def _free(self) -> int:
        """Slots free now (conservative: a group being written may count twice)."""
        if not self.max_depth:
            return UNBOUNDED
        unwritten = self._unwritten  # before the read: a group written meanwhile is counted
        return self.max_depth - await self.buffer.backlog() - unwritten

    def _write(self, group: Group) -> Awaitable[str]:
        """Queue `group` for the next PUT, packed now: a group that does not pack fails its
        own producer (ValueError naming the field), not the batch it would have joined."""
        packed = pack(group)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue.append((packed, future))
        # A writer takes the queue when it starts and after each PUT: one is made for the
        # first group queued since (the others join it), while fewer are under way; and
        # whenever the newest is gone (cancelled before it took the queue). No list is made
        # per group: this runs for every group the router puts.
        if len(self._queue) == 1 or not self._writers or self._writers[-1].done():
            self._start_writer()
        return future

    def _busy_writers(self) -> int:
        self._writers = [writer for writer in self._writers if not writer.done()]
        return len(self._writers)

    def _start_writer(self) -> None:
        """A writer for the queue, unless `puts_in_flight` are under way."""
        if self._busy_writers() < self.puts_in_flight:
            self._writers.append(asyncio.create_task(self._write_queued(), name="buffer writer"))

    async def _write_queued(self) -> None:
        """Write what is queued, one PUT per round, until the queue is empty. A queue of
        SPLIT_MIN or more groups while another writer could start is halved between them: the
        producers of each half then make their next groups while the server runs the other's."""
        while self._queue:
            batch, self._queue = self._queue, []
            if len(batch) >= SPLIT_MIN and self._busy_writers() < self.puts_in_flight:
                batch, self._queue = batch[: len(batch) // 2], batch[len(batch) // 2 :]
                self._start_writer()
            try:
                ids, backlog = await self.buffer.put_batch([group for group, _ in batch])
            except Exception as exc:  # the producers see it (a RedisError: Redis is down)
                for _group, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            finally:
                self._unwritten -= len(batch)
            if self.max_depth:  # the room as of the put: never less than known (the trainer
                # only consumes meanwhile), and no read of the counters of its own
                self._room = max(self._room, self.max_depth - backlog - self._unwritten)
                self._let_go()
            for (_group, future), entry in zip(batch, ids, strict=True):
                if not future.done():
                    future.set_result(entry)
