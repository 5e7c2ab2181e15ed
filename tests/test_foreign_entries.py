"""Entries written to the samples stream outside the router's path (a tool, another program,
a hand-made XADD): the run never counted them put, so the trainer must not count them consumed
(the router's demand gate and depth bound read `groups_put - groups_consumed`), nor train them;
each is recorded as a drop with its reason. Real Valkey server, the trainer's real intake."""

from __future__ import annotations

from proto import encode
from proto.drops import DeadLetterReason
from proto.packed import encode_entry, pack
from services.sample_buffer import SampleBuffer
from tests.test_trainer_batching import group
from tests.test_trainer_intake import intake_of


def test_foreign_entries_are_dropped_as_foreign_and_leave_the_demand_gates_backlog_alone(
    buffer: SampleBuffer,
) -> None:
    put = [group(0, [0.0, 1.0], gid=f"put{i}") for i in range(4)]
    buffer.put_group(put[0])
    # A well-formed entry, one of two groups in the router's own packing, one of an older
    # encoding and one of garbage, none through the ledger's PUT.
    foreign = [group(0, [1.0, 0.0], gid=f"foreign{i}") for i in range(3)]
    buffer.redis.xadd(buffer.samples_key, {"d": encode_entry([pack(foreign[0]), pack(foreign[1])])})
    buffer.redis.xadd(buffer.samples_key, {"d": encode(foreign[2])})
    buffer.redis.xadd(buffer.samples_key, {"d": b"\x00not msgpack"})
    buffer.put_groups(put[1:])
    assert buffer.backlog() == 4  # what the gate reads: the router's four groups

    intake = intake_of(buffer, 4)
    rollout = intake.read_rollout(0, lambda: False)
    assert rollout is not None
    assert [g.group_id for g in rollout.groups] == [f"put{i}" for i in range(4)]
    letters = buffer.dead_letters()
    assert [letter.reason for letter in letters] == [DeadLetterReason.FOREIGN_ENTRY] * 3
    assert "2 groups decoded" in letters[0].detail and "0 groups decoded" in letters[2].detail
    counters = buffer.counters()
    # Nothing foreign counted consumed (the four put are counted by the trainer's step), nor
    # as the trainer's dead letters (a resume's rewind counts those consumed).
    assert counters.get("groups_consumed", 0) == 0 and buffer.backlog() == 4
    assert counters.get("groups_dead_lettered", 0) == 0
    ledger = buffer.ledger()
    assert ledger.dropped_groups == {"dead_lettered": 4}  # 2 + 1 + 1 (garbage: one entry)
    assert ledger.dropped_samples == {"dead_lettered": 6}
    assert ledger.balanced, ledger.sentence()
