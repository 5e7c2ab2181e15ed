"""What a killed router or a resumed trainer leaves in the ledger, put right.

A router that dies leaves its groups in `in_flight` and its agent sessions in `open_sessions`:
the next router drops them as `cancelled` (`in_flight_drop`, `open_drop`; one router per run
id). A trainer resumed from a checkpoint takes back what it counted after that checkpoint
(`rewind_trainer`). Each writes through the ledger's own scripts and keys (ledger.py).
"""

from __future__ import annotations

import logging

import redis

from proto import DropRecord
from proto.drops import DropReason
from services.sample_buffer.keys import BufferKeys, trained_of

log = logging.getLogger("tandem.ledger")


def open_drop(source: str, name: str, samples: int) -> DropRecord:
    """The drop of an agent session (or a group of them, `group:NAME`) a killed router left
    open (`AsyncSampleBuffer.note_open`), as its stop would have recorded it."""
    return DropRecord(
        source=source,
        reason=DropReason.CANCELLED,
        samples=samples,
        group_id=name,
        detail="open when the router stopped without ending it (killed, or Redis refused its "
        "writes)",
    )


def in_flight_drop(source: str, group_id: bytes) -> DropRecord:
    """The drop of a group a killed router left in flight."""
    return DropRecord(
        source=source,
        reason=DropReason.CANCELLED,
        count=1,
        group_id=group_id.decode(),
        detail="in flight when the router stopped without ending it (killed, or Redis refused its "
        "writes); its prompt is drawn again",
    )


def say_recovered(groups: int) -> None:
    """Say how many groups a killed router left in flight (dropped, prompts drawn again)."""
    if groups:
        log.warning("%d groups were in flight when the last router died: drawn again", groups)


# Counter: groups trained by earlier lineages (--new-lineage), which the `trained` hash no
# longer lists: a rewind keeps them in `groups_trained`.
EARLIER = "groups_trained_earlier"


def rewind_trainer(
    client: redis.Redis, keys: BufferKeys, groups_consumed: int, version: int
) -> None:
    """A trainer resumed at `version` from a checkpoint that had consumed `groups_consumed`:
    the groups it trained or dropped after that checkpoint are pending again, so they leave
    `trained`, `groups_trained` and the drop counts (they will be counted when consumed again).
    Drops noted at a trainer version >= `version` came after the checkpoint was saved."""
    trained = trained_of(client.hgetall(keys.trained_key))
    earlier = int(client.hget(keys.counters_key, EARLIER) or 0)
    kept = earlier + sum(len(ids) for v, ids in trained.items() if v <= version)
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.counters_key, "groups_consumed", groups_consumed)
    pipe.hset(keys.counters_key, "groups_trained", kept)
    later = [str(v) for v in trained if v > version]
    if later:
        pipe.hdel(keys.trained_key, *later)
    for group_id, noted in client.hgetall(keys.trainer_drops_key).items():
        at, reason, groups, samples = noted.decode().split(" ")
        if int(at) >= version:
            pipe.hincrby(keys.drops_key, f"{reason}:groups", -int(groups))
            pipe.hincrby(keys.drops_key, f"{reason}:samples", -int(samples))
            pipe.hdel(keys.trainer_drops_key, group_id)
    pipe.execute()
