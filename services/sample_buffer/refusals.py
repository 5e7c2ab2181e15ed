"""A Redis that answers but refuses writes: which refusal, and what to change.

A server whose disk is full under its append-only file answers MISCONF to every write, one at
its maxmemory OOM, a replica READONLY, one short of its min-replicas NOREPLICAS; PING still
answers, and the refusal lasts until its cause is gone. The trainer waits one out like a lost
connection (--redis-timeout-s, redis_wait.py); the router waits until a write goes through
(`AsyncSampleBuffer.wait_writable`); both say the hint.
"""

from __future__ import annotations

import re

import redis

HINTS = {
    "MISCONF": "it cannot write its append-only file or snapshot: the disk under its data "
    "folder (tandem up: RUN_DIR/redis) is full or unwritable; free space there",
    "OOM": "it is at its maxmemory: raise maxmemory, or lower the router's --max-buffer-depth",
    "READONLY": "it is a read-only replica: point --redis-url at the primary",
    "NOREPLICAS": "it has fewer replicas than its min-replicas-to-write: bring them back or "
    "lower that setting",
}
# (redis-py strips the code of these two from the message)
CLASSES = {redis.exceptions.OutOfMemoryError: "OOM", redis.exceptions.ReadOnlyError: "READONLY"}
CODE = re.compile(r"\b(MISCONF|OOM|READONLY|NOREPLICAS)\b")  # (inside a pipeline's or script's)


def refusal(exc: BaseException | None) -> str | None:
    """What to change when `exc` is a Redis refusing writes; None for any other error."""
    if not isinstance(exc, redis.ResponseError):
        return None
    code = next((c for cls, c in CLASSES.items() if isinstance(exc, cls)), None)
    if code is None and (found := CODE.search(str(exc))):
        code = found.group(1)
    return HINTS.get(code) if code else None


def hint_of(exc: BaseException | None) -> str:
    """`refusal(exc)` as a clause to append to a message (": what to change"), else ""."""
    return f": {why}" if (why := refusal(exc)) else ""
