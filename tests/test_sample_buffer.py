"""SampleBuffer against a real Valkey server process."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from proto import DropReason, DropRecord, Sample, SampleGroup
from proto.contract import ContractMismatchError, RunContract, ServiceStatus
from proto.packed import decode_entry, encode_entry, entry_of, pack, unpack
from proto.run_terms import RunPlace
from services.sample_buffer import BufferConfig, SampleBuffer


def make_group(group_id: str, version: int = 0) -> SampleGroup:
    sample = Sample(
        prompt_ids=[1, 4, 5],
        response_ids=[6, 2],
        response_logprobs=[-0.5, -0.125],  # float32 on the stream: exact
        loss_mask=[1, 1],
        reward=1.0,
        weight_version=version,
    )
    return SampleGroup(
        group_id=group_id,
        prompt="01>",
        label="10",
        samples=[sample],
        weight_version=version,
        created_at=time.time(),
    )


def test_groups_come_out_in_order_with_their_contents(buffer: SampleBuffer) -> None:
    for i in range(3):
        buffer.put_group(make_group(f"g{i}", version=i))
    got = buffer.read_groups("t0", count=10, block_ms=100)
    assert [g.group_id for _, g in got] == ["g0", "g1", "g2"]
    assert got[1][1].samples[0].response_logprobs == [-0.5, -0.125]
    assert got[2][1].weight_version == 2


def test_acked_groups_free_space_and_unacked_ones_are_handed_out_again(
    buffer: SampleBuffer,
) -> None:
    for i in range(4):
        buffer.put_group(make_group(f"g{i}"))
    first = buffer.read_groups("t0", count=2, block_ms=100)
    buffer.ack([first[0][0]])
    assert buffer.depth() == 3
    assert buffer.counters_and_depth() == ({"groups_put": 4, "groups_generated": 4}, 3)
    # A restarted consumer gets its unacked group back before new ones: nothing is lost.
    again = buffer.read_groups("t0", count=3, block_ms=100, pending_first=True)
    assert [g.group_id for _, g in again] == ["g1", "g2", "g3"]


def test_drops_are_counted_by_reason_in_groups_and_in_samples_and_logged(
    buffer: SampleBuffer,
) -> None:
    stale = DropReason.STALE
    buffer.record_drop(DropRecord(source="trainer", reason=stale, samples=8, group_id="g1"))
    buffer.record_drop(DropRecord(source="trainer", reason=stale, samples=8, group_id="g2"))
    buffer.record_drop(
        DropRecord(source="router", reason=DropReason.REWARD_ERROR, count=0, samples=1)
    )
    buffer.record_drop(DropRecord(source="router", reason=DropReason.ENGINE_ERROR, samples=2))
    assert buffer.drop_counts() == {"stale": 2, "engine_error": 1}
    assert buffer.drop_counts("samples") == {"stale": 16, "reward_error": 1, "engine_error": 2}
    assert [r.group_id for r in buffer.drop_log()][:3] == ["", "", "g2"]


def test_versions_and_metrics_round_trip(buffer: SampleBuffer) -> None:
    assert buffer.get_version("engines") == -1
    buffer.set_version("engines", 7)
    assert buffer.get_version("engines") == 7
    buffer.publish_metrics("trainer", 3, {"train/loss": 0.25})
    records = buffer.read_metrics()
    assert records[-1][1].values == {"train/loss": 0.25}
    assert records[-1][1].step == 3
    assert buffer.read_metrics(after_id=records[-1][0]) == []


def test_the_buffer_config_is_the_run_place_and_its_typed_limits() -> None:
    """Where the buffer lives is the run's `RunPlace` (declared once, in proto), also given as
    `BufferConfig(redis_url, run_id)`; its limits are range-checked by their types."""
    config = BufferConfig("redis://h:1/0", "r", metrics_len=5)
    assert isinstance(config, RunPlace)
    assert (config.redis_url, config.run_id, config.metrics_len) == ("redis://h:1/0", "r", 5)
    assert BufferConfig().run_id == RunPlace().run_id
    with pytest.raises(ValueError, match="redis_call_timeout_s"):
        BufferConfig(redis_call_timeout_s=0)


def test_an_unreachable_server_is_named_in_the_error() -> None:
    dead = SampleBuffer(BufferConfig(redis_url="redis://127.0.0.1:1/0"))
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:1"):
        dead.wait_ready(timeout_s=0.3)


def test_a_server_starts_with_a_relative_log_folder(tmp_path, monkeypatch) -> None:
    from services.sample_buffer import RedisServer

    monkeypatch.chdir(tmp_path)
    with RedisServer(log_dir=Path("runs/x/logs")) as server:
        assert SampleBuffer(BufferConfig(redis_url=server.url)).redis.ping()
    assert (tmp_path / "runs/x/logs/redis.log").exists()


def test_the_first_service_sets_the_run_contract_and_a_contradiction_names_the_flag(
    buffer: SampleBuffer,
) -> None:
    router = RunContract(model_id="llama:abc", rollout_batch_size=16, max_staleness=1)
    assert buffer.agree_contract(router, "router").rollout_batch_size == 16
    # The trainer states more terms; the ones the router set must match, the rest are added.
    trainer = RunContract(model_id="llama:abc", rollout_batch_size=16, num_steps_per_rollout=2)
    run = buffer.agree_contract(trainer, "trainer")
    assert (run.rollout_batch_size, run.num_steps_per_rollout, run.max_staleness) == (16, 2, 1)
    with pytest.raises(ContractMismatchError) as exc:
        buffer.agree_contract(RunContract(rollout_batch_size=64), "trainer")
    message = str(exc.value)
    assert "16" in message and "64" in message and "--rollout-batch-size" in message
    assert "set by the router" in message
    assert buffer.contract().num_steps_per_rollout == 2


def test_puts_are_counted_with_the_entry_and_statuses_expire(buffer: SampleBuffer) -> None:
    for i in range(3):
        buffer.put_group(make_group(f"g{i}"))
    buffer.incr_counter("groups_consumed", 1)
    assert buffer.record_trained(1, ["g0"]).balanced
    buffer.incr_counter("groups_consumed", 1)
    assert buffer.record_trained(2, ["g1"]).balanced
    buffer.rewind_trainer(1, 1)  # resumed from the checkpoint of step 1: g1 is pending again
    assert buffer.trained() == {1: ["g0"]}
    buffer.incr_counter("groups_consumed", 2)
    assert buffer.record_trained(2, ["g1", "g2"]).balanced  # step 2 trained again: replaced
    assert buffer.trained() == {1: ["g0"], 2: ["g1", "g2"]}
    assert buffer.counters() == {
        "groups_put": 3,
        "groups_generated": 3,  # put without being started: generated and put at once
        "groups_consumed": 3,
        "groups_trained": 3,
    }
    buffer.set_status(ServiceStatus(role="trainer", state="waiting", waiting_for="groups"))
    buffer.set_status(ServiceStatus(role="router", state="generating"), ttl_s=0.05)
    time.sleep(0.2)
    statuses = buffer.statuses()
    assert list(statuses) == ["trainer"] and statuses["trainer"].waiting_for == "groups"


def test_a_trainer_step_counts_records_and_acks_in_one_script(buffer: SampleBuffer) -> None:
    """`record_trained` with `consumed` and `ack` (a step without --save): the groups counted
    consumed and trained, the lineage written, the entries acked and deleted, and the ledger
    after it returned; an entry not acked stays pending."""
    keys = [buffer.put_group(make_group(f"g{i}")) for i in range(3)]
    assert len(buffer.read_entries("t0", 3)) == 3 and buffer.pending_count() == 3
    after = buffer.record_trained(1, ["g0", "g1"], consumed=2, ack=keys[:2])
    assert after.balanced and (after.trained, after.consumed, after.buffered) == (2, 2, 1)
    assert after == buffer.ledger()
    assert buffer.trained() == {1: ["g0", "g1"]}
    assert buffer.pending_count() == 1 and buffer.depth() == 1
    assert buffer.read_entries("t0", 3, "0")[0][0] == entry_of(keys[2])


def test_a_server_on_a_data_folder_comes_back_with_its_keys_after_kill_9(tmp_path: Path) -> None:
    from services.sample_buffer import RedisServer

    data = tmp_path / "redis"
    first = RedisServer(log_dir=tmp_path / "logs", data_dir=data).start()
    buf = SampleBuffer(BufferConfig(redis_url=first.url, run_id="r"))
    buf.put_group(make_group("g0"))
    buf.agree_contract(RunContract(rollout_batch_size=8), "router")
    time.sleep(1.5)  # appendfsync everysec: what a kill -9 can lose is the last second
    assert first.process is not None
    first.process.kill()
    first.process.wait()
    with RedisServer(log_dir=tmp_path / "logs", data_dir=data) as second:
        again = SampleBuffer(BufferConfig(redis_url=second.url, run_id="r"))
        assert [g.group_id for _, g in again.read_groups("t", 10, block_ms=None)] == ["g0"]
        assert again.counters()["groups_put"] == 1
        assert again.contract().rollout_batch_size == 8


def test_packed_groups_come_back_as_they_were_put_and_a_value_that_does_not_fit_is_named() -> None:
    group = make_group("g0", version=2)
    group.samples[0].token_versions = [1, 2]  # a partial rollout continued on newer weights
    group.samples.append(msgspec.structs.replace(group.samples[0], loss_mask=[0, 1]))
    packed = pack(group)
    assert packed.samples[0].mask == b"" and packed.samples[0].versions != b""
    back = unpack(decode_entry(encode_entry([packed]))[0])  # type: ignore[index]
    assert back.samples[1].loss_mask == [0, 1] and back.samples[0].token_versions == [1, 2]
    assert back.samples[0].response_ids == [6, 2] and back.samples[0].response_logprobs == [
        -0.5,
        -0.125,
    ]
    assert unpack(pack(make_group("g1", 4))).samples[0].token_versions == [4, 4], "written out"
    too_big = make_group("g2")
    too_big.samples[0].response_ids = [6, 1 << 40]
    with pytest.raises(ValueError, match="group g2: response_ids holds a value that is no int32"):
        pack(too_big)


def test_a_batch_is_cut_into_entries_by_count_and_encoded_size_and_read_back_in_order(
    buffer: SampleBuffer,
) -> None:
    small = [pack(make_group(f"s{i}")) for i in range(130)]
    keys = buffer.put_groups(small)  # 64 + 64 + 2 groups an entry
    assert [key.split("/")[1] for key in keys[62:66]] == ["62", "63", "0", "1"]
    assert len({key.split("/")[0] for key in keys}) == 3 and buffer.depth() == 130
    # 6 groups of ~300 KB each: 1.8 MB encoded, halved until each entry is under 1 MiB
    big = make_group("b")
    big.samples[0].response_ids = list(range(37_500))
    big.samples[0].response_logprobs = [-0.5] * 37_500
    big.samples[0].loss_mask = [1] * 37_500
    large = [msgspec.structs.replace(pack(big), group_id=f"b{i}") for i in range(6)]
    entries = [key.split("/")[0] for key in buffer.put_groups(large)]
    assert [entries.count(e) for e in dict.fromkeys(entries)] == [3, 3]
    got = buffer.read_groups("t0", count=10, block_ms=100)
    assert [g.group_id for _, g in got] == [f"s{i}" for i in range(130)] + [
        f"b{i}" for i in range(6)
    ]
    assert got[-1][1].samples[0].response_ids == list(range(37_500))
    assert buffer.depth() == 136


def test_a_cancel_that_redis_py_swallows_in_a_failing_call_still_ends_the_task() -> None:
    """redis.asyncio swallows a CancelledError that arrives mid-command; when the command then
    fails (Redis down), the old `io` let its error through and a loop that catches RedisError
    went on for good: a router stopping with its Redis dead never stopped (its status task)."""
    import asyncio
    import contextlib

    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError

    from services.sample_buffer.aio import io

    async def command() -> None:  # as redis-py does with a cancel while it reconnects
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    async def status_loop() -> None:
        for _ in range(300):  # (the old code: 3 s, then it ends, not cancelled)
            try:
                await io(command())
            except RedisError:
                await asyncio.sleep(0.01)

    async def main() -> None:
        task = asyncio.create_task(status_loop())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait([task], timeout=10)
        assert task.cancelled(), "the task went on after its cancel"

    asyncio.run(main())


def test_read_ahead_reads_the_next_entries_while_the_last_are_used_and_loses_none(
    buffer: SampleBuffer,
) -> None:
    from services.sample_buffer.read_ahead import ReadAhead
    from tests.helpers import wait_until

    keys = [buffer.put_group(make_group(f"g{i}")) for i in range(3)]
    ahead = ReadAhead(buffer, "t0")
    assert [i for i, _ in ahead.read(1, block_ms=100)] == [entry_of(keys[0])]
    # the next read is sent at once: g1 is delivered (pending) before it is asked for
    wait_until(lambda: buffer.pending_count() == 2, "the read ahead took g1")
    assert [i for i, _ in ahead.read(5, block_ms=100)] == [entry_of(keys[1])]  # its count: 1
    wait_until(lambda: buffer.pending_count() == 3, "the read ahead took g2")
    # A reader that stops here holds g2 unasked for; its next start reads it first.
    again = buffer.read_entries("t0", 10, "0")
    assert [i for i, _ in again] == [entry_of(k) for k in keys]
    assert [i for i, _ in ahead.read(5, block_ms=100)] == [entry_of(keys[2])]
    # An empty read starts none: the next read is made then, with its own count.
    assert ahead.read(5, block_ms=100) == []
    more = [buffer.put_group(make_group(f"h{i}")) for i in range(2)]
    assert [i for i, _ in ahead.read(5, block_ms=100)] == [entry_of(k) for k in more]


def test_a_read_ahead_whose_server_went_away_raises_the_clients_error_from_the_next_read(
    tmp_path: Path,
) -> None:
    import redis

    from services.sample_buffer import RedisServer
    from services.sample_buffer.read_ahead import ReadAhead

    server = RedisServer(log_dir=tmp_path).start()
    try:
        buffer = SampleBuffer(BufferConfig(redis_url=server.url, run_id="ahead"))
        key = buffer.put_group(make_group("g0"))
        ahead = ReadAhead(buffer, "t0")
        assert [i for i, _ in ahead.read(1, block_ms=5000)] == [entry_of(key)]
    finally:
        server.stop()  # while the read ahead waits for a new entry
    for _ in range(2):  # (the read sent, then one made anew)
        with pytest.raises(redis.ConnectionError):
            ahead.read(1, block_ms=100)
