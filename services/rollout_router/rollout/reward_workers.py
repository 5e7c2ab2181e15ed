"""Worker processes for a `--custom-rm-path` function (`--rm-workers`).

A reward function runs user code: a math verifier that takes a second on one answer, or never
returns on another, would hold up the router's event loop (its HTTP API, the engines' health
checks, every other rollout) for as long. So each call goes to an idle worker process and is
bounded by `--rm-timeout-s`: a worker that overruns it is killed and replaced and its sample
dropped as `reward_error`, naming the flag; a worker that dies is replaced the same way; a
call cancelled (the rollout stopped) leaves its worker to finish it before the next. Workers
are new interpreters (the router has threads: no fork), load the function themselves from its
path, say when they are ready (the timeout counts from then), and die with the router (Linux:
their parent's death signals them, even while the function hangs).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

# A worker's start (the interpreter, then the function's imports) may take the longer of this
# and --rm-timeout-s: a function whose module loads a model raises --rm-timeout-s.
START_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1


class RewardCallError(RuntimeError):
    """A call that got no value: the function raised, overran the timeout or its worker died.
    The text completes "reward function NAME ..."."""


class RewardTimeoutError(RewardCallError):
    """A call that overran --rm-timeout-s (counted apart: the console gives its share)."""


def _serve(path: str, conn: Connection) -> None:
    """A worker's life: load the function, say ready (and whether it is `async`) or why not,
    then answer each call with ("ok", value) or ("raised", text) until the router closes the
    pipe."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: killed by close() only
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # A terminal's Ctrl-C or hang-up, and tandem up's SIGTERM to the router's process group, are
    # the router's to handle: it finishes or cancels the calls in flight, then stops its workers.
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    from services.rollout_router.rollout.custom_reward import load_function

    try:
        fn = load_function(path)
    except ValueError as exc:
        conn.send(("failed", str(exc)))
        return
    conn.send(("ready", inspect.iscoroutinefunction(fn)))
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", fn(*args))
        except Exception as exc:  # the user's function: its error is the sample's
            reply = ("raised", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except Exception:  # a value that does not pickle: its text (not a number)
            conn.send(("ok", repr(reply[1])))


class Worker:
    """One process (`python -m` this module: nothing of the router's own start is run again)
    and its end of a socket pair."""

    def __init__(self, path: str) -> None:
        mine, theirs = socket.socketpair()
        # The router's module search path, so `module:fn` is found where the router found it.
        search = [entry or os.getcwd() for entry in sys.path]
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, path, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(search)},
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(mine.detach())
        self.ready = False
        self.is_async = False  # the function is `async def` (said once ready)

    async def receive(self) -> tuple[str, Any]:
        """The next message; RewardCallError when the process died."""
        loop = asyncio.get_running_loop()
        arrived: asyncio.Future[None] = loop.create_future()
        fd = self.conn.fileno()

        def readable() -> None:
            if not arrived.done():
                arrived.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await arrived
        finally:
            loop.remove_reader(fd)
        try:
            return self.conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            raise self.ended() from None

    def send(self, message: tuple[Any, ...]) -> None:
        try:
            self.conn.send(message)
        except OSError:  # it died while idle
            raise self.ended() from None

    def ended(self) -> RewardCallError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(1.0)
        return RewardCallError(f"ended its worker process (exit code {self.process.returncode})")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and not self.conn.closed

    def kill(self) -> None:
        self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5.0)
        self.conn.close()


class RewardWorkers:
    """Up to `count` workers for the function at `path`, started when first needed."""

    def __init__(self, path: str, count: int, timeout_s: float) -> None:
        self.path, self.count, self.timeout_s = path, count, timeout_s
        self.idle: list[Worker] = []
        self.busy: set[Worker] = set()
        self._freed: asyncio.Condition | None = None
        self._drains: set[asyncio.Task] = set()

    async def start(self) -> bool:
        """Start the first worker now: a function that does not load fails the router's start
        (RewardCallError), not every sample. Whether it is `async` (then the router's loop runs
        it, not these workers)."""
        worker = Worker(self.path)
        await self._ready(worker)
        self.idle.append(worker)
        return worker.is_async

    async def call(self, text: str, label: str, stopped: bool) -> Any:
        """The function's value for one response; RewardCallError naming what went wrong."""
        worker, draining = await self._take(), False
        try:
            worker.send((text, label, stopped))
            async with asyncio.timeout(self.timeout_s):
                status, value = await worker.receive()
        except TimeoutError:
            worker.kill()
            raise RewardTimeoutError(
                f"did not return within {self.timeout_s:g}s (--rm-timeout-s): its worker "
                "process was killed and is replaced"
            ) from None
        except asyncio.CancelledError:  # (the rollout stopped): its answer is still to come
            draining = True
            drain = asyncio.create_task(self._drain(worker), name="reward worker drain")
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
            raise
        except BaseException:
            worker.kill()
            raise
        finally:
            if not draining:
                await self._give_back(worker)
        if status == "raised":
            raise RewardCallError(f"raised {value}")
        return value

    async def _drain(self, worker: Worker) -> None:
        """Read the answer of a cancelled call, within --rm-timeout-s, before the worker
        takes another call: killed, it would load the function's module again (a verifier's
        model, minutes). Killed when it overruns, as a call would be."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await worker.receive()
        except BaseException:  # overran, died, or the loop is closing
            worker.kill()
        await self._give_back(worker)

    async def _take(self) -> Worker:
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            await self._freed.wait_for(lambda: self.idle or len(self.busy) < self.count)
            worker = self.idle.pop() if self.idle else Worker(self.path)
            self.busy.add(worker)
        if not worker.ready:
            try:
                await self._ready(worker)
            except BaseException:
                await self._give_back(worker)
                raise
        return worker

    async def _ready(self, worker: Worker) -> None:
        """A new worker's first message: ready, or why it could not load the function (the
        worker is killed then). Its start may take the longer of START_TIMEOUT_S and the
        calls' timeout."""
        bound_s = max(START_TIMEOUT_S, self.timeout_s)
        try:
            async with asyncio.timeout(bound_s):
                status, detail = await worker.receive()
        except TimeoutError:
            status, detail = (
                "failed",
                (
                    f"not ready within {bound_s:g}s (loading the function's module: raise "
                    "--rm-timeout-s, which bounds a worker's start too when longer than 60 s)"
                ),
            )
        except BaseException:
            worker.kill()
            raise
        if status != "ready":
            worker.kill()
            raise RewardTimeoutError(f"could not start in a worker process: {detail}")
        worker.ready, worker.is_async = True, bool(detail)

    async def _give_back(self, worker: Worker) -> None:
        assert self._freed is not None
        async with self._freed:
            self.busy.discard(worker)
            if worker.alive:
                self.idle.append(worker)
            self._freed.notify()

    def close(self) -> None:
        for worker in [*self.idle, *self.busy]:
            worker.kill()
        self.idle.clear()
        self.busy.clear()


if __name__ == "__main__":
    _serve(sys.argv[1], Connection(int(sys.argv[2])))
