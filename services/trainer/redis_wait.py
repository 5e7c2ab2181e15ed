"""The trainer's Redis client waits out a lost connection instead of dying on the first error.

Every command (pipelines included) that fails with a connection error or a timeout is retried
until it succeeds or `timeout_s` have passed since the first failure, and so is one that a Redis
refusing writes answers (MISCONF: its disk full; OOM, READONLY: sample_buffer/refusals.py, whose
hint the messages give; a refused command did not run); the wait is logged once when it starts
and once when Redis answers again. After the bound, `RedisUnavailableError` names the URL and
the flag. A Redis refusing the password (TANDEM_REDIS_PASSWORD) is not waited out:
RedisPasswordError names the variable at once. A command Redis ran whose reply was lost is run
again: the stream commands the trainer retries (XREADGROUP, XACK, XDEL, SET) are idempotent or
harmless twice; a counter increment (HINCRBY) cut off that way may count once more.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.sample_buffer.password import password_option, password_refusal
from services.sample_buffer.refusals import refusal

log = logging.getLogger("tandem.trainer")
T = TypeVar("T")


class RedisUnavailableError(redis.ConnectionError):
    """Redis did not answer within the trainer's --redis-timeout-s."""


class PatientRetry(Retry):
    """redis-py retry policy bounded by time, not by count (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float, give_up: Callable[[], bool]) -> None:
        errors = (redis.ConnectionError, redis.TimeoutError, socket.timeout)
        super().__init__(NoBackoff(), -1, errors)
        self.url, self.timeout_s, self.give_up = url, timeout_s, give_up

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        since, failures = 0.0, 0
        while True:
            try:
                result = do()
            except Exception as error:
                hint = refusal(error)  # (a Redis refusing writes: waited out the same way)
                if refused := password_refusal(self.url, error):
                    raise refused from None  # (a wrong password does not heal with time)
                lost = isinstance(error, self._supported_errors)
                if hint is None and not (lost and (not is_retryable or is_retryable(error))):
                    if not lost:  # an answer, if an error (a server back without its data)
                        self._back(failures, since)
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                now = time.monotonic()
                since = now if failures == 1 else since
                self._wait_or_give_up(error, hint, failures, now - since)
                time.sleep(min(0.1 * 2**failures, 2.0))
                continue
            self._back(failures, since)
            return result

    def _wait_or_give_up(
        self, error: Exception, hint: str | None, failures: int, waited_s: float
    ) -> None:
        """Say the wait at its start; RedisUnavailableError at a stop or past the bound."""
        what = f"refuses writes ({error}): {hint}" if hint else f"does not answer ({error})"
        if failures == 1:
            print(
                f"[trainer] Redis at {self.url} {what}; waiting up to {self.timeout_s:.0f}s "
                "(--redis-timeout-s)",
                flush=True,
            )
        if self.give_up():  # a stop was asked for: waiting would only delay it
            raise RedisUnavailableError(
                f"Redis at {self.url} {what}, and a stop was asked for: stopping without "
                "waiting for it (what was not checkpointed stays in Redis, unacknowledged)"
            ) from error
        if waited_s >= self.timeout_s:
            ended = "refused writes" if hint else "did not answer"
            raise RedisUnavailableError(
                f"Redis at {self.url} {ended} for {self.timeout_s:.0f}s (--redis-timeout-s; last "
                f"error: {error}): {hint or 'is the server running? (--redis-url)'}"
            ) from error

    def _back(self, failures: int, since: float) -> None:
        if failures:
            print(
                f"[trainer] Redis at {self.url} answers again after "
                f"{time.monotonic() - since:.1f}s",
                flush=True,
            )


def patient_client(
    url: str, timeout_s: float, read_block_ms: int, give_up: Callable[[], bool] = lambda: False
) -> redis.Redis:
    """A client whose commands wait out a lost connection for up to `timeout_s`, or until
    `give_up()` (the trainer's stop) says not to. The socket timeout outlasts the longest
    blocking read, so a server that vanished without closing the connection is noticed too."""
    return redis.Redis.from_url(
        url,
        retry=PatientRetry(url, timeout_s, give_up),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        socket_connect_timeout=5.0,
        socket_timeout=read_block_ms / 1000 + 30.0,
        **password_option(),
    )
