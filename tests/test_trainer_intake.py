"""The trainer's intake of sample groups is robust and exactly-once: a bad entry is dead-lettered
(never trained, never a crash), a skipped update never counts as trained, a restart trains what
was read but not trained exactly once (a dead consumer's pending groups included), the stream
never loses an unacked entry, a fresh trainer on a used run is refused, and a lost Redis is
waited for (real Valkey, real CLI subprocesses with the toy model)."""

from __future__ import annotations

import math
import struct
import threading
import time
from pathlib import Path

import msgspec
import pytest
import redis

from proto import SampleGroup, encode
from proto.drops import DeadLetterReason as R
from proto.drops import DropReason
from proto.packed import Group, pack
from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from services.sample_buffer.refusals import refusal
from services.trainer.intake import Limits, Rejected, check_group, check_groups, decode_groups
from services.trainer.redis_wait import RedisUnavailableError, patient_client
from tests.test_trainer_batching import group
from tests.test_trainer_process import run_trainer, sample_groups

LIMITS = Limits(vocab_size=16, max_tokens=64, max_response_len=8)  # the toy model's


def renamed(groups: list[SampleGroup], prefix: str) -> list[SampleGroup]:
    for i, g in enumerate(groups):
        g.group_id = f"{prefix}{i}"
    return groups


def bad_entries(good: SampleGroup) -> dict[str, tuple[R, dict[bytes, bytes]]]:
    """One entry of each kind the trainer must not train: name -> (reason, raw fields)."""

    def variant(change, **group_fields) -> dict[bytes, bytes]:  # type: ignore[no-untyped-def]
        g = msgspec.structs.replace(good, **group_fields)
        g.samples = [msgspec.structs.replace(s) for s in good.samples]
        change(g.samples[0])
        return {b"d": encode(g)}

    raw = msgspec.msgpack.decode(encode(good))
    no_id = {k: v for k, v in raw.items() if k != "group_id"}
    entries = {
        "garbage": (R.UNDECODABLE, {b"d": b"\x00\xffnot msgpack at all"}),
        "wrong_fields": (R.UNDECODABLE, {b"payload": encode(good)}),
        "schema_2": (
            R.SCHEMA_VERSION,
            {b"d": msgspec.msgpack.encode({**raw, "schema_version": 2})},
        ),
        "no_group_id": (R.MISSING_FIELD, {b"d": msgspec.msgpack.encode(no_id)}),
        "oov": (
            R.TOKEN_OUT_OF_VOCAB,
            variant(lambda s: setattr(s, "response_ids", [99, *s.response_ids[1:]])),
        ),
        "lengths": (R.LENGTH_MISMATCH, variant(lambda s: setattr(s, "loss_mask", [1] * 9))),
        "beyond_context": (
            R.TOO_LONG,
            variant(lambda s: setattr(s, "prompt_ids", [1] * 100_000), group_id="long"),
        ),
        "long_response": (
            R.TOO_LONG,
            variant(
                lambda s: (
                    setattr(s, "response_ids", [5] * 20),
                    setattr(s, "response_logprobs", [-1.0] * 20),
                    setattr(s, "loss_mask", [1] * 20),
                )
            ),
        ),
        "nan_reward": (R.NONFINITE_REWARD, variant(lambda s: setattr(s, "reward", math.nan))),
        "future": (R.FUTURE_VERSION, variant(lambda s: None, weight_version=10**6)),
        "foreign": (  # made by weights older than the lineage's first version
            R.FOREIGN_LINEAGE,
            variant(lambda s: setattr(s, "weight_version", good.weight_version - 1)),
        ),
    }
    # (each as the router's path writes an entry: with the ledger PUT's count `n`)
    return {name: (reason, {**fields, b"n": b"1"}) for name, (reason, fields) in entries.items()}


def check_entry(
    fields: dict[bytes, bytes], limits: Limits, version: int, lineage_floor: int = 0
) -> Group | Rejected:
    """The first group of an entry, checked (`check_group`), or why the entry is rejected."""
    groups = decode_groups("", fields)
    if isinstance(groups, Rejected):
        return groups
    return check_group(groups[0][1], limits, version, lineage_floor)


def test_each_bad_entry_is_rejected_with_its_reason_and_a_good_group_passes() -> None:
    good = group(5, [0.0, 1.0], gid="ok")  # a new lineage's first version is 5
    assert check_entry({b"d": encode(good)}, LIMITS, version=5, lineage_floor=5) == good
    for name, (reason, fields) in bad_entries(good).items():
        rejected = check_entry(fields, LIMITS, version=5, lineage_floor=5)
        assert isinstance(rejected, Rejected) and rejected.reason == reason, (name, rejected)
    old = msgspec.structs.replace(good, weight_version=-3)  # stale, not foreign, by default
    assert check_entry({b"d": encode(old)}, LIMITS, version=5) == old


def test_an_entry_checked_at_once_rejects_exactly_what_each_group_check_rejects() -> None:
    """`check_groups` checks a whole packed entry in one pass: each bad group among good ones
    gets the reason `check_group` gives it, and the good ones pass."""
    good = group(5, [0.0, 1.0], gid="ok")
    packed = pack(good)
    assert check_groups([packed, packed], LIMITS, version=5, lineage_floor=5) == [packed, packed]
    assert check_groups([], LIMITS, version=5) == []  # every group of the entry trained before
    first = packed.samples[0]
    bad = {
        name: pack(msgspec.msgpack.decode(fields[b"d"], type=SampleGroup))
        for name, (_, fields) in bad_entries(good).items()
        if name not in ("garbage", "wrong_fields", "schema_2", "no_group_id")
    }
    bad["schema_2"] = msgspec.structs.replace(packed, schema_version=2)
    bad["no_group_id"] = msgspec.structs.replace(packed, group_id="")
    for name, change in {  # the first sample's packed arrays, changed
        "torn": {"response": first.response[:-1]},
        "negative_id": {"response": struct.pack("<i", -1) + first.response[4:]},
        "future_token": {"versions": struct.pack("<2i", 5, 6)},
        "short_mask": {"mask": b"\x01"},
    }.items():
        sample = msgspec.structs.replace(first, **change)
        bad[name] = msgspec.structs.replace(packed, samples=[sample, *packed.samples[1:]])
    assert len(bad) == 13
    for name, group_ in bad.items():
        expected = check_group(group_, LIMITS, version=5, lineage_floor=5)
        assert isinstance(expected, Rejected), name
        verdicts = check_groups([packed, group_, packed], LIMITS, version=5, lineage_floor=5)
        assert verdicts == [packed, expected, packed], name
    older = msgspec.structs.replace(packed, weight_version=-1)  # no lineage floor: stale only
    assert check_groups([older], LIMITS, version=5) == [older]


def test_dead_letter_keeps_the_raw_entry_acks_and_deletes_it_and_records_the_drop(
    buffer: SampleBuffer,
) -> None:
    from proto import DropRecord

    entry_id = buffer.redis.xadd(buffer.samples_key, {"d": b"\x00junk"}).decode()
    ((read_id, fields),) = buffer.read_entries("trainer-0", 10, ">")
    assert read_id == entry_id
    drop = DropRecord(source="trainer", reason=DropReason.DEAD_LETTERED, count=1, detail="x")
    buffer.dead_letter(entry_id, fields, R.UNDECODABLE, "not msgpack", drop)
    (letter,) = buffer.dead_letters()
    assert (letter.entry_id, letter.reason, letter.detail) == (
        entry_id,
        "undecodable",
        "not msgpack",
    )
    assert letter.fields == {b"d": b"\x00junk"}
    assert buffer.depth() == 0 and buffer.pending_count() == 0
    assert buffer.drop_counts() == {"dead_lettered": 1}


def test_reclaim_moves_a_dead_consumers_pending_groups_only_once_they_are_idle(
    buffer: SampleBuffer,
) -> None:
    ids = [buffer.put_group(group(0, [1.0], gid=f"g{i}")).split("/")[0] for i in range(3)]
    assert [i for i, _ in buffer.read_entries("dead-trainer", 3, ">")] == ids
    assert buffer.reclaim("trainer-0", min_idle_ms=60_000) == 0  # it may still be alive
    assert buffer.read_entries("trainer-0", 10, "0") == []
    time.sleep(0.05)
    assert buffer.reclaim("trainer-0", min_idle_ms=20) == 3
    assert [i for i, _ in buffer.read_entries("trainer-0", 10, "0")] == ids
    assert buffer.read_entries("dead-trainer", 10, "0") == []


def test_the_samples_stream_is_never_trimmed_and_ack_removes_only_acked(
    buffer: SampleBuffer,
) -> None:
    # The bound on what producers put is the router's (--max-buffer-depth,
    # tests/test_buffer_backpressure.py); the stream itself drops nothing unread.
    ids = [buffer.put_group(group(0, [1.0], gid=f"g{i}")).split("/")[0] for i in range(4)]
    buffer.read_entries("trainer-0", 4, ">")  # all read, none acked
    buffer.ack(ids[:2])
    assert buffer.depth() == 2 and buffer.pending_count() == 2
    assert [i for i, _ in buffer.read_entries("trainer-0", 10, "0")] == ids[2:]


def test_a_lost_redis_is_waited_for_and_after_the_bound_named_by_its_url(tmp_path: Path) -> None:
    server = RedisServer(log_dir=tmp_path).start()
    try:
        client = patient_client(server.url, timeout_s=20.0, read_block_ms=2000)
        buffer = SampleBuffer(BufferConfig(redis_url=server.url, run_id="lost"), client)
        buffer.put_group(group(0, [1.0], gid="g0"))
        assert len(buffer.read_entries("trainer-0", 1, ">")) == 1
        server.requested_port = server.port  # come back where the client looks

        def restart() -> None:  # while the read below blocks: gone for 0.5 s, back empty
            server.stop()
            time.sleep(0.5)
            server.start()

        outage = threading.Timer(0.3, restart)
        outage.start()
        assert buffer.read_entries("trainer-0", 1, ">", block_ms=2000) == []  # no crash
        outage.join()
        buffer.put_group(group(0, [1.0], gid="g1"))  # the same client goes on
        assert [g.group_id for _, g in buffer.read_groups("trainer-0", 1, 100)] == ["g1"]
        server.stop()
        impatient = patient_client(server.url, timeout_s=0.5, read_block_ms=100)
        with pytest.raises(RedisUnavailableError, match=server.url.replace("/", ".")) as err:
            impatient.ping()
        assert isinstance(err.value, redis.ConnectionError) and "--redis-timeout-s" in str(
            err.value
        )
        # A trainer asked to stop does not wait out --redis-timeout-s for a Redis that is gone.
        stopping = patient_client(server.url, 60.0, 100, give_up=lambda: True)
        started = time.monotonic()
        with pytest.raises(RedisUnavailableError, match="a stop was asked for"):
            stopping.ping()
        assert time.monotonic() - started < 10
    finally:
        server.stop()


def test_a_redis_refusing_writes_is_waited_for_and_after_the_bound_named_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Redis whose disk is full answers MISCONF to every write (here: OOM at a maxmemory of 1
    byte, the same kind of refusal): the trainer died on the first with a traceback."""
    server = RedisServer(log_dir=tmp_path).start()
    try:
        admin = redis.Redis.from_url(server.url)
        client = patient_client(server.url, timeout_s=20.0, read_block_ms=100)
        admin.config_set("maxmemory", 1)
        threading.Timer(0.5, lambda: admin.config_set("maxmemory", 0)).start()
        client.set("k", "v")  # refused until the timer lifts the limit
        assert client.get("k") == b"v"
        said = capsys.readouterr().out
        assert "refuses writes" in said and "it is at its maxmemory" in said, said
        admin.config_set("maxmemory", 1)
        impatient = patient_client(server.url, timeout_s=0.5, read_block_ms=100)
        with pytest.raises(RedisUnavailableError, match="refused writes for 0s") as err:
            impatient.pipeline().set("k", "w").execute()
        assert "--redis-timeout-s" in str(err.value) and "raise maxmemory" in str(err.value)
        admin.config_set("maxmemory", 0)
        with pytest.raises(redis.ResponseError, match="wrong number"):  # other errors: at once
            impatient.execute_command("GET")
    finally:
        server.stop()


def test_every_refusal_of_writes_gets_its_hint_and_other_errors_none() -> None:
    assert "disk under its data folder" in str(
        refusal(redis.ResponseError("MISCONF Errors writing to the AOF file: No space left"))
    )
    wrapped = "Command # 1 (XADD k * d x) of pipeline caused error: MISCONF Errors writing"
    assert refusal(redis.ResponseError(wrapped)) == refusal(redis.ResponseError("MISCONF x"))
    assert "read-only replica" in str(refusal(redis.exceptions.ReadOnlyError("You can't")))
    assert "min-replicas" in str(refusal(redis.ResponseError("NOREPLICAS Not enough")))
    for other in (redis.ResponseError("WRONGTYPE Operation"), redis.ConnectionError("gone"), None):
        assert refusal(other) is None


def trainer_args(toy_model_dir: Path, buffer: SampleBuffer, *extra: str) -> list[str]:
    return [
        "--model",
        str(toy_model_dir),
        "--redis-url",
        buffer.config.redis_url,
        "--run-id",
        buffer.config.run_id,
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--read-block-ms",
        "200",
        "--max-staleness",
        "10",
        "--max-response-len",
        "8",
        "--lr",
        "1e-3",  # the toy model's rate, as tandem up passes it
        *extra,
    ]


def test_bad_entries_are_dead_lettered_skipped_updates_not_trained_and_pending_trained_once(
    buffer: SampleBuffer, toy_model_dir: Path
) -> None:
    # The run's trainer published version 20 and died without a checkpoint: this one starts a
    # new lineage at 21 (--new-lineage), and groups made by version 20 are foreign to it.
    buffer.set_version("trainer", 20)
    buffer.record_trained(20, ["old"])
    good = renamed(sample_groups(toy_model_dir, 6, 2, weight_version=21, seed=21), "good")
    bad = bad_entries(good[0])
    nan_logp = renamed(sample_groups(toy_model_dir, 2, 2, weight_version=21, seed=22), "nanlogp")
    for g in nan_logp:  # a broken engine: the step's loss is NaN and its update skipped
        for s in g.samples:
            s.response_logprobs = [math.nan] * len(s.response_ids)
    steps: list[list[SampleGroup | str]] = [
        ["garbage", good[0], "wrong_fields", good[1]],  # read before the start, never acked
        ["schema_2", "nan_reward", good[2], "oov", good[3]],  # the NaN-reward group is not in it
        [nan_logp[0], "lengths", nan_logp[1]],  # skipped
        ["beyond_context", "long_response", "future", "foreign", "no_group_id", good[4], good[5]],
    ]
    order = [item for step in steps for item in step]
    bad_ids = {}
    for item in order:
        if isinstance(item, str):
            bad_ids[buffer.redis.xadd(buffer.samples_key, bad[item][1]).decode()] = item
        else:
            buffer.put_group(item)
    # Trainers that died with groups read and not trained (bad ones too, which crashed every
    # restart before): one under another --consumer, gone for good, and one under this one's.
    assert len(buffer.read_entries("old-trainer", 2, ">")) == 2
    assert len(buffer.read_entries("trainer-0", 2, ">")) == 2
    args = trainer_args(toy_model_dir, buffer, "--max-steps", "25", "--reclaim-min-idle-s", "0")
    done = run_trainer([*args, "--new-lineage"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "--new-lineage: starting from --model as version 21" in done.stdout
    assert "took over 4 pending groups" in done.stdout  # the old consumer's and its own

    letters = buffer.dead_letters()
    assert {letter.entry_id: letter.reason for letter in letters} == {
        i: bad[name][0] for i, name in bad_ids.items()
    }
    assert all(letter.fields == bad[bad_ids[letter.entry_id]][1] for letter in letters)
    for reason in {bad[name][0] for name in bad_ids.values()}:  # the first of each is logged
        assert done.stdout.count(f"({reason}, at version") == 1, reason
    assert buffer.trained() == {  # the old lineage's record is gone
        22: ["good0", "good1"],  # each pending group trained once
        23: ["good2", "good3"],
        24: [],  # the skipped update trained nothing
        25: ["good4", "good5"],
    }
    drops, drop_samples = buffer.drop_counts(), buffer.drop_counts("samples")
    assert drops[DropReason.SKIPPED_UPDATE] == 2  # the two NaN-log-prob groups
    assert drop_samples[DropReason.SKIPPED_UPDATE] == 4  # their 2 samples each
    decoded = {
        "oov",
        "lengths",
        "beyond_context",
        "long_response",
        "nan_reward",
        "future",
        "foreign",
    }
    assert drops[DropReason.DEAD_LETTERED] == len(bad_ids)  # one group per entry
    assert drop_samples[DropReason.DEAD_LETTERED] == sum(  # samples where the group decoded
        len(good[0].samples) for name in bad_ids.values() if name in decoded
    )
    metrics = {r.step: r.values for _, r in buffer.read_metrics() if r.source == "trainer"}
    assert math.isfinite(metrics[23]["train/loss"])  # one NaN-reward group poisons nothing
    assert metrics[24]["train/skipped_updates"] == 1 and metrics[25]["train/skipped_updates"] == 1
    assert buffer.get_version("trainer") == 25
    assert buffer.depth() == 0 and buffer.pending_count() == 0
    assert buffer.counters()["groups_consumed"] == len(order)


def test_a_fresh_trainer_on_a_run_that_already_trained_is_refused_with_exit_2(
    buffer: SampleBuffer, toy_model_dir: Path
) -> None:
    buffer.set_version("trainer", 20)  # a run's trainer published version 20, then died
    buffer.record_trained(20, ["g"])
    done = run_trainer(trainer_args(toy_model_dir, buffer, "--max-steps", "1"))
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "already has trainer version 20" in done.stderr
    assert "point --save/--load at this run's checkpoint folder" in done.stderr
    assert "new --run-id" in done.stderr and "--new-lineage" in done.stderr
    assert buffer.get_version("trainer") == 20  # nothing was published


def intake_of(buffer: SampleBuffer, batch: int):  # type: ignore[no-untyped-def]
    from services.trainer.config import TrainerConfig
    from services.trainer.rollout import Intake

    cfg = TrainerConfig(model="m", rollout_batch_size=batch, read_block_ms=100)
    return Intake(cfg, buffer, LIMITS, lambda *a, **k: None)


def test_an_entry_of_several_groups_split_across_steps_is_acked_once_all_are_trained_exactly_once(
    buffer: SampleBuffer,
) -> None:
    keys = buffer.put_groups([group(0, [0.0, 1.0], gid=f"g{i}") for i in range(3)])
    entry = keys[0].split("/")[0]
    assert [k.split("/")[0] for k in keys] == [entry] * 3 and buffer.depth() == 3
    first = intake_of(buffer, 2)
    rollout = first.read_rollout(0, lambda: False)
    assert rollout is not None and [g.group_id for g in rollout.groups] == ["g0", "g1"]
    first.unacked += rollout.entry_ids  # trained; a checkpoint is saved, then the acks
    saved = first.checkpoint_keys()
    assert sorted(saved) == keys[:2]
    first.ack_done()
    assert buffer.depth() == 3 and buffer.pending_count() == 1, "g2 is not trained yet"
    # A crash here: a trainer resumed from that checkpoint trains g2 only.
    resumed = intake_of(buffer, 1)
    resumed.already_trained = set(saved)
    again = resumed.read_rollout(0, lambda: False)
    assert again is not None and [g.group_id for g in again.groups] == ["g2"]
    assert sorted(resumed.checkpoint_keys()) == keys[:2], "a checkpoint keeps g0 and g1 named"
    resumed.unacked += again.entry_ids
    resumed.ack_done()
    assert buffer.depth() == 0 and buffer.pending_count() == 0
    assert resumed.checkpoint_keys() == [] and resumed.open == {}


def test_a_bad_group_in_an_entry_is_dead_lettered_alone_and_its_neighbours_are_trained(
    buffer: SampleBuffer,
) -> None:
    groups = [group(0, [0.0, 1.0], gid=f"g{i}") for i in range(3)]
    groups[1].samples[0].reward = math.nan
    keys = buffer.put_groups(groups)
    intake = intake_of(buffer, 2)
    rollout = intake.read_rollout(0, lambda: False)
    assert rollout is not None and [g.group_id for g in rollout.groups] == ["g0", "g2"]
    assert all(k.split("/")[0] != keys[0].split("/")[0] for k in rollout.entry_ids), "re-written"
    (letter,) = buffer.dead_letters()
    assert (letter.entry_id, letter.reason) == (keys[1], R.NONFINITE_REWARD)
    assert buffer.counters()["groups_dead_lettered"] == 1
    assert buffer.drop_counts() == {"dead_lettered": 1}
    assert buffer.depth() == 2 and buffer.pending_count() == 1  # the new entry, in hand
    intake.unacked += rollout.entry_ids
    intake.ack_done()
    assert buffer.depth() == 0 and buffer.pending_count() == 0


def test_a_torn_packed_array_is_dead_lettered_as_undecodable_not_a_crash(
    buffer: SampleBuffer,
) -> None:
    from proto.packed import encode_entry, pack

    packed = pack(group(0, [0.0, 1.0], gid="torn"))
    torn = msgspec.structs.replace(packed.samples[0], response=packed.samples[0].response[:-1])
    bad = msgspec.structs.replace(packed, samples=[torn, packed.samples[1]])
    buffer.redis.xadd(
        buffer.samples_key,
        {"d": encode_entry([bad, pack(group(0, [1.0], gid="ok"))]), "n": b"2"},
    )
    rollout = intake_of(buffer, 1).read_rollout(0, lambda: False)
    assert rollout is not None and [g.group_id for g in rollout.groups] == ["ok"]
    (letter,) = buffer.dead_letters()
    assert letter.reason == R.UNDECODABLE and "not whole 4-byte values" in letter.detail


def test_reading_groups_back_to_back_reports_the_status_at_most_every_wait_report_s(
    buffer: SampleBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.trainer import rollout as rollout_module

    for i in range(8):  # eight entries of one group, read one at a time: eight reads a rollout
        buffer.put_group(group(0, [0.0, 1.0], gid=f"g{i}"))
    reports: list[int] = []
    intake = intake_of(buffer, 4)
    intake.report = lambda *a, **k: reports.append(k["groups_in_hand"])  # type: ignore[method-assign]
    read, reads = intake.ahead.read, []

    def one_at_a_time(count: int, block_ms: int):  # type: ignore[no-untyped-def]
        reads.append(count)
        return read(1, block_ms)

    monkeypatch.setattr(intake.ahead, "read", one_at_a_time)
    for _ in range(2):
        assert intake.read_rollout(0, lambda: False) is not None
    assert len(reads) >= 8 and reports == [0], "one status for reads within WAIT_REPORT_S"
    monkeypatch.setattr(rollout_module, "WAIT_REPORT_S", 0.0)  # later reads report when due
    for i in range(4):
        buffer.put_group(group(0, [0.0, 1.0], gid=f"h{i}"))
    assert intake.read_rollout(0, lambda: False) is not None
    assert reports[1:] == [0, 1, 2, 3]


def test_groups_dead_lettered_in_a_row_are_said_while_waiting_and_then_stop_the_trainer(
    buffer: SampleBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Samples that cannot fit this trainer (its token budget, here set to 2): every group is
    dead-lettered, the router replaces it, and the trainer would wait for good ones for ever.
    Its status says why it waits, and after DEAD_LETTERS_IN_A_ROW it stops, naming it; a bad
    group among good ones resets nothing but itself."""
    from services.trainer import rollout as rollout_module
    from services.trainer.rollout import DeadLettersError

    monkeypatch.setattr(rollout_module, "DEAD_LETTERS_IN_A_ROW", 6)
    monkeypatch.setattr(rollout_module, "WAIT_REPORT_S", 0.0)
    mixed = [group(0, [0.0, 1.0], gid=f"m{i}") for i in range(10)]
    for bad in mixed[::2]:  # every other one: five in all, never two in a row
        bad.samples[0].reward = math.nan
    for g in mixed:
        buffer.put_group(g)
    intake = intake_of(buffer, 5)
    rollout = intake.read_rollout(0, lambda: False)
    assert rollout is not None and len(rollout.groups) == 5 and intake.letters_in_a_row == 0
    intake.unacked += rollout.entry_ids  # trained
    intake.ack_done()
    # Groups of versions from the buffer's past (here: not yet published) are dead-lettered
    # without counting: a backlog of them drains by itself.
    for i in range(8):
        buffer.put_group(group(99, [0.0, 1.0], gid=f"future{i}"))
    buffer.put_groups([group(0, [0.0, 1.0], gid=f"ok{i}") for i in range(2)])
    intake = intake_of(buffer, 2)
    rollout = intake.read_rollout(0, lambda: False)
    assert rollout is not None and [g.group_id for g in rollout.groups] == ["ok0", "ok1"]
    intake.unacked += rollout.entry_ids
    intake.ack_done()
    for i in range(8):
        buffer.put_group(group(0, [0.0, 1.0], gid=f"long{i}"))
    details: list[str] = []
    intake = intake_of(buffer, 2)
    intake.limits = Limits(vocab_size=16, max_tokens=2, max_response_len=8)
    intake.report = lambda state, detail, **k: details.append(detail)  # type: ignore[method-assign]
    with pytest.raises(DeadLettersError) as stopped:
        intake.read_rollout(0, lambda: False)
    assert str(stopped.value).startswith(
        "the last 6 groups were all dead-lettered (none fit to train among them), the last as "
        "too_long: sample 0: "
    ) and str(stopped.value).endswith("the samples do not fit this trainer; fix what that names")
    assert any(" groups were dead-lettered, the last as too_long: sample 0" in d for d in details)
    ledger = buffer.ledger()
    assert ledger.balanced and ledger.dropped_groups == {"dead_lettered": 19}, ledger.table()
