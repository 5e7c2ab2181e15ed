"""Rewards: built-in verifiers, a Python function (module or file path), or a remote reward service.

Every reward is `async score(prompt, response_text, label, finish_reason) -> float`.
A built-in or dotted-path function has the signature `fn(response_text, label, stopped) -> float`
(`stopped` = generation ended on a stop token, not the length limit); it may be `async`.
The remote service gets `POST rm_url {"prompt", "response", "label", "finish_reason"}` and
answers `{"reward": float}`; each call has a timeout and is retried with backoff.

A reward that cannot be had is a `RewardError` with its drop reason: `reward_error` (the
function raised or returned None, the service kept failing) or `reward_nonfinite` (NaN or inf,
which would make every loss NaN). `score_all` returns it in place of that sample's reward: the
rollout loop drops that sample and keeps the others. The first failure of each reason is logged
with its text, later ones with a count only (the drops hash counts every one).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from proto import DropReason
from services.rollout_router.config import RewardConfig
from services.rollout_router.rollout.calls import InFlight
from services.rollout_router.rollout.custom_reward import load_function, split_path
from services.rollout_router.rollout.reward_workers import (
    RewardCallError,
    RewardTimeoutError,
    RewardWorkers,
)
from services.rollout_router.rollout.toy_task import reverse_digits_reward

log = logging.getLogger("tandem.router.rewards")

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(RuntimeError):
    """A reward could not be computed; `reason` is its drop counter (`reward_error`,
    `reward_nonfinite`)."""

    def __init__(
        self, detail: str, reason: DropReason = DropReason.REWARD_ERROR, timed_out: bool = False
    ) -> None:
        super().__init__(detail)
        self.reason, self.timed_out = reason, timed_out  # timed_out: past --rm-timeout-s


def as_reward(value: Any, source: str) -> float:
    """`value` as a finite float, else a RewardError naming `source`."""
    if value is None:
        raise RewardError(f"{source} returned None")
    if isinstance(value, (str, bytes)):  # (float("42") is 42.0: an answer taken for a score)
        raise RewardError(f"{source} returned {value!r}, text: return a number")
    try:
        reward = float(value)
    except (TypeError, ValueError) as exc:
        raise RewardError(f"{source} returned {value!r}, not a number") from exc
    if not math.isfinite(reward):
        raise RewardError(f"{source} returned {reward}", DropReason.REWARD_NONFINITE)
    return reward


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a.replace(",", "")) - float(b.replace(",", ""))) < 1e-6
    except ValueError:
        return a.strip() == b.strip()


def exact_match(text: str, label: str, stopped: bool) -> float:
    """1 when the response, stripped, equals the label."""
    return float(text.strip() == label.strip())


def last_number(text: str, label: str, stopped: bool) -> float:
    """1 when the last number in the response equals the label numerically (GSM8K style)."""
    numbers = NUMBER.findall(text)
    return float(bool(numbers) and _same_number(numbers[-1], label))


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def boxed(text: str, label: str, stopped: bool) -> float:
    """1 when the last `\\boxed{}` answer equals the label (spaces and `$` ignored, numbers
    compared numerically)."""
    answer = last_boxed(text)
    if answer is None:
        return 0.0

    def norm(s: str) -> str:
        return s.replace(" ", "").replace("$", "").strip()

    a, b = norm(answer), norm(label)
    return float(a == b or _same_number(a, b))


BUILTIN: dict[str, Callable[[str, str, bool], float]] = {
    "reverse_digits": reverse_digits_reward,
    "exact_match": exact_match,
    "last_number": last_number,
    "boxed": boxed,
}


class Reward:
    """One of: a local function (built-in or dotted path) in the router's loop, the same run by
    worker processes (`workers`: the router never imports it; `name` names it), or a remote
    service."""

    def __init__(
        self,
        fn: Callable[..., Any] | None = None,
        url: str = "",
        timeout_s: float = 30.0,
        retries: int = 2,
        session: aiohttp.ClientSession | None = None,
        workers: RewardWorkers | None = None,
        max_errors_in_a_row: int = 0,
        name: str = "",
    ) -> None:
        self.fn, self.url, self.timeout_s, self.retries = fn, url, timeout_s, retries
        self.session, self.workers = session, workers
        self.failures: Counter[str] = Counter()
        # a function's failures since its last reward, and the bound (0: none) past which it
        # is broken, not unlucky (`broken`)
        self.in_a_row, self.max_in_a_row, self.last_error = 0, max_errors_in_a_row, ""
        name = name or getattr(fn, "__qualname__", repr(fn))
        self.source = f"reward service {url}" if url else f"reward function {name}"
        bound = f"--rm-timeout-s {timeout_s:g}"
        bound += f", {workers.count} --rm-workers" if workers is not None else ""
        self.calls = InFlight(f"calls to {self.source}", bound)

    def activity(self) -> str:
        """The calls in flight, the oldest's age, and the failures in a row ("" when idle)."""
        failed = f"; the last {self.in_a_row} failed, the last: {self.last_error}"
        return self.calls.describe() + (failed if self.calls.started and self.in_a_row else "")

    async def score(self, prompt: Any, text: str, label: str, finish_reason: str) -> float:
        """The reward, or RewardError (also for an exception of the function: its text)."""
        try:
            with self.calls.one():
                if self.url:
                    reward = await self._remote(prompt, text, label, finish_reason)
                elif self.workers is not None:
                    value = await self.workers.call(text, label, finish_reason == "stop")
                    reward = as_reward(value, self.source)
                else:
                    assert self.fn is not None
                    value = self.fn(text, label, finish_reason == "stop")
                    if inspect.isawaitable(value):
                        value = await self._bounded(value)
                    reward = as_reward(value, self.source)
        except RewardError as exc:
            self._note(exc)
            raise
        except RewardCallError as exc:  # (its text completes the source's name)
            error = RewardError(
                f"{self.source} {exc}", timed_out=isinstance(exc, RewardTimeoutError)
            )
            self._note(error)
            raise error from None
        except Exception as exc:  # a user's function: anything it raises fails this sample only
            error = RewardError(f"{self.source} raised {type(exc).__name__}: {exc}")
            self._note(error)
            raise error from exc
        self.in_a_row = 0
        return reward

    def broken(self) -> str:
        """Why the run must stop, or "": a function that failed on `max_in_a_row` samples in a
        row is broken, not unlucky (a remote service may come back: the loop backs off)."""
        if self.url or not self.max_in_a_row or self.in_a_row < self.max_in_a_row:
            return ""
        return (
            f"{self.source} failed on {self.in_a_row} samples in a row "
            f"(--rm-max-errors-in-a-row {self.max_in_a_row}), the last: {self.last_error}; fix "
            "the function (--custom-rm-path; a wrong or unparsable answer should score 0, not "
            "fail), or raise the router's --rm-max-errors-in-a-row N (0 = never stop; tandem up "
            "takes it as it is)"
        )

    async def _bounded(self, value: Awaitable[Any]) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await value
        except TimeoutError:
            raise RewardTimeoutError(
                f"did not return within {self.timeout_s:g}s (--rm-timeout-s)"
            ) from None

    def close(self) -> None:
        """Stop the worker processes, if any."""
        if self.workers is not None:
            self.workers.close()

    async def score_all(
        self, prompt: Any, outputs: list[tuple[str, str]], label: str
    ) -> list[float | RewardError]:
        """Rewards of (text, finish_reason) pairs, a RewardError in place of each that failed;
        a plain local function runs inline, without a task per sample."""

        async def one(text: str, finish: str) -> float | RewardError:
            try:
                return await self.score(prompt, text, label, finish)
            except RewardError as exc:
                return exc

        if (
            self.fn is not None
            and self.workers is None
            and not inspect.iscoroutinefunction(self.fn)
        ):
            return [await one(text, finish) for text, finish in outputs]
        return list(await asyncio.gather(*(one(t, f) for t, f in outputs)))

    def _note(self, error: RewardError) -> None:
        """Log the first failure of each reason with its text, then at 10, 100, 1000, ..."""
        self.failures[error.reason] += 1
        self.in_a_row, self.last_error = self.in_a_row + 1, str(error)[:300]
        count = self.failures[error.reason]
        if count == 1:
            log.warning(
                "%s (%s; its samples are dropped and counted): %s", self.source, error.reason, error
            )
        elif math.log10(count).is_integer():
            log.warning("%s: %d samples dropped as %s so far", self.source, count, error.reason)

    async def _remote(self, prompt: Any, text: str, label: str, finish_reason: str) -> float:
        assert self.session is not None, "a remote Reward needs the router's HTTP session"
        body = {"prompt": prompt, "response": text, "label": label, "finish_reason": finish_reason}
        last, timed_out = "", False
        for attempt in range(self.retries + 1):
            try:
                timeout = aiohttp.ClientTimeout(total=self.timeout_s)
                async with self.session.post(self.url, json=body, timeout=timeout) as resp:
                    if resp.status == 200:
                        return as_reward((await resp.json())["reward"], self.source)
                    last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                timed_out = isinstance(exc, TimeoutError)
            await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
        failed = f"reward service {self.url} failed {self.retries + 1} times: {last}"
        raise RewardError(failed + (" (--rm-timeout-s)" if timed_out else ""), timed_out=timed_out)


async def make_reward(config: RewardConfig, session: aiohttp.ClientSession | None) -> Reward:
    """The reward the flags ask for (one of `--rm-url`, `--custom-rm-path`, `--rm-type`); a
    plain (not async) `--custom-rm-path` function runs in `--rm-workers` processes (0: inline)
    and is `broken` after `--rm-max-errors-in-a-row` failures in a row (0: never). With
    workers, the first one loads the function before the router serves (a bad path, or a
    function that cannot be called so, fails the start) and the router never imports it (a
    verifier that loads a model, starts threads or sets up logging at import does so in its
    workers only); an `async` one is imported by the router and runs in its loop."""
    path, timeout_s, workers = config.custom_rm_path, config.rm_timeout_s, config.reward_workers()
    limit = config.rm_max_errors_in_a_row
    if config.rm_url:
        return Reward(
            url=config.rm_url, timeout_s=timeout_s, retries=config.rm_retries, session=session
        )
    if path:
        if workers:
            pool = RewardWorkers(path, workers, timeout_s)
            try:
                is_async = await pool.start()
            except RewardCallError as exc:  # its text names the path when the import failed
                said = str(exc)
                raise ValueError(
                    said if "--custom-rm-path" in said else f"--custom-rm-path {path!r}: {said}"
                ) from None
            if not is_async:
                log.info(
                    f"reward function {path} runs in up to {workers} worker processes "
                    f"(--rm-workers), each call bounded by --rm-timeout-s {timeout_s:g}s"
                )
                name = split_path(path)[1]
                return Reward(
                    timeout_s=timeout_s, workers=pool, max_errors_in_a_row=limit, name=name
                )
            pool.close()
        fn = load_function(path)  # a bad path fails the start
        return Reward(fn, timeout_s=timeout_s, max_errors_in_a_row=limit)
    return Reward(BUILTIN[config.rm_type or "reverse_digits"])  # (the toy task's by default)
