"""The trainer is never stuck and never silent: it refuses a run whose terms contradict the
others', counts the groups it consumes for the router's demand gate, says what it waits for,
and fails a run whose updates were all skipped (real Valkey, real CLI subprocess)."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import msgspec

from proto.contract import RunContract, SampleLimits
from services.trainer.lease import trainer_membership
from tests.helpers import wait_until
from tests.test_trainer_process import common_args, run_trainer, sample_groups


def test_a_trainer_whose_batch_size_contradicts_the_run_contract_exits_2_naming_the_flag(
    buffer, toy_model_dir: Path
) -> None:
    buffer.agree_contract(RunContract(rollout_batch_size=16), "router")
    args = [*common_args(toy_model_dir, buffer), "--max-steps", "1"]
    args[args.index("--rollout-batch-size") + 1] = "64"
    done = run_trainer(args)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "rollout_batch_size is 16" in done.stderr and "64" in done.stderr
    assert "--rollout-batch-size" in done.stderr and "router" in done.stderr
    assert "trainer" not in buffer.statuses()  # refused before the model was loaded
    assert buffer.contract().rollout_batch_size == 16


def test_a_trainer_given_gpus_it_cannot_see_exits_2_instead_of_training_on_cpu(
    buffer, toy_model_dir: Path, monkeypatch
) -> None:
    """--trainer-gpus 99 (an index no machine has; here, or no GPU at all): before, the
    trainer trained on CPU without a word."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "99")
    done = run_trainer([*common_args(toy_model_dir, buffer), "--max-steps", "1"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "CUDA_VISIBLE_DEVICES=99 (tandem up's --trainer-gpus) names GPUs" in done.stderr
    assert "trainer" not in buffer.statuses()  # refused before the model was loaded


def nan_groups(toy_model_dir: Path, n: int) -> list:  # type: ignore[type-arg]
    groups = sample_groups(toy_model_dir, n, 2, seed=5)
    for g in groups:
        for s in g.samples:
            s.response_logprobs = [math.nan] * len(s.response_ids)  # a broken engine
    return groups


def test_three_skipped_updates_in_a_row_end_the_run_with_exit_1_naming_steps_and_cause(
    buffer, toy_model_dir: Path
) -> None:
    for g in nan_groups(toy_model_dir, 3):
        buffer.put_group(g)
    args = [*common_args(toy_model_dir, buffer), "--max-steps", "3", "--max-staleness", "9"]
    args[args.index("--rollout-batch-size") + 1] = "1"
    args[args.index("--n-samples-per-prompt") + 1] = "2"
    done = run_trainer(args)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "steps 1, 2, 3 were skipped, 3 in a row" in done.stderr
    assert "not finite" in done.stderr and "--max-skipped-in-a-row 3" in done.stderr
    assert "--lr" in done.stderr and "--on-nonfinite fail" in done.stderr
    status = buffer.statuses()["trainer"]
    assert status.state == "failed" and "skipped" in status.error


def test_a_run_whose_every_update_was_skipped_exits_1_even_below_the_streak_limit(
    buffer, toy_model_dir: Path
) -> None:
    for g in nan_groups(toy_model_dir, 2):
        buffer.put_group(g)
    args = [*common_args(toy_model_dir, buffer), "--max-steps", "2", "--max-skipped-in-a-row", "0"]
    args[args.index("--rollout-batch-size") + 1] = "1"
    args[args.index("--n-samples-per-prompt") + 1] = "2"
    done = run_trainer(args)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "every update of this run was skipped (2 steps)" in done.stderr


def test_status_says_what_the_trainer_waits_for_and_groups_consumed_counts_trained_and_stale(
    buffer, toy_model_dir: Path, start_service
) -> None:
    trainer = start_service("trainer", ["trainer", *common_args(toy_model_dir, buffer)])

    def waiting() -> object:
        status = buffer.statuses().get("trainer")
        return status if status and status.state == "waiting for samples" else None

    first = wait_until(waiting, "the trainer's status 'waiting for samples'", 60)
    assert first.waiting_for.startswith("sample groups: 0 of 4 for step 1 (buffer holds 0")
    assert "groups put 0, consumed 0" in first.waiting_for
    never_put = (
        f"no group was ever put in run {buffer.config.run_id!r} at {buffer.config.redis_url}"
    )
    assert never_put in first.waiting_for and "--run-id" in first.waiting_for
    assert first.detail["groups_needed"] == 4 and first.detail["version"] == 0
    assert first.pid == trainer.proc.pid
    # it stated the longest sample it takes (the toy model's 64 positions; --max-response-len)
    stated = msgspec.json.decode(buffer.redis.get(buffer.limits_key), type=SampleLimits)
    assert stated == SampleLimits(max_tokens=64, max_response_len=32768)
    wait_until(
        lambda: buffer.statuses()["trainer"].updated_at > first.updated_at + 1,
        "the status refreshed while the trainer waits in blocking reads",
    )
    assert buffer.statuses()["trainer"].since == first.since  # the same wait goes on

    stale = sample_groups(toy_model_dir, 1, 4, weight_version=-5, seed=1)
    for g in [*stale, *sample_groups(toy_model_dir, 4, 4, seed=2)]:
        buffer.put_group(g)
    wait_until(lambda: buffer.get_version("trainer") == 1, "step 1", 120)
    wait_until(lambda: buffer.counters().get("groups_consumed") == 5, "5 groups consumed")
    assert buffer.counters()["groups_put"] == 5
    assert buffer.drop_counts() == {"stale": 1} and buffer.drop_counts("samples") == {"stale": 4}
    after = wait_until(waiting, "the wait for step 2")
    assert "for step 2" in after.waiting_for and "groups put 5, consumed 5" in after.waiting_for
    assert "no group was ever put" not in after.waiting_for
    trainer.stop()
    assert trainer.proc.returncode == 0, trainer.log()[-3000:]
    assert buffer.statuses()["trainer"].state == "stopped"
    assert buffer.depth() == 0


def test_the_status_stays_fresh_while_the_loop_is_blocked_in_one_long_call(buffer) -> None:
    from services.trainer.status import StatusReporter

    reporter = StatusReporter(trainer_membership(buffer), interval_s=0.2)
    try:
        reporter.update("publishing", "the weight broker to take version 1", version=1)
        first = buffer.statuses()["trainer"]
        assert first.waiting_for == "the weight broker to take version 1"
        assert first.detail == {"version": 1} and first.since > 0
        wait_until(  # nobody calls update(): the reporter's thread rewrites it
            lambda: buffer.statuses()["trainer"].updated_at > first.updated_at + 0.3,
            "a refreshed status",
        )
        assert buffer.statuses()["trainer"].since == first.since
    finally:
        reporter.close("failed", "broker gone")
    last = buffer.statuses()["trainer"]
    assert (last.state, last.waiting_for, last.error) == ("failed", "", "broker gone")


def test_a_status_that_cannot_be_written_is_said_once_until_it_is_written_again(
    buffer, caplog
) -> None:
    """A Redis refusing writes for minutes (its disk full) had the trainer's log say "status
    not written" every 2 s; once a streak now, and when it is written again."""
    from services.trainer.status import StatusReporter

    reporter = StatusReporter(trainer_membership(buffer), interval_s=0.1)
    try:
        with caplog.at_level("WARNING", logger="tandem.trainer"):
            buffer.redis.config_set("maxmemory", 1)
            try:
                time.sleep(0.6)  # ~6 refreshes refused
            finally:
                buffer.redis.config_set("maxmemory", 0)
            wait_until(lambda: "written again" in caplog.text, "a status written again")
    finally:
        reporter.close()
    said = [r.getMessage() for r in caplog.records if "status" in r.getMessage()]
    assert len(said) == 2 and "not written (retried every 0.1s)" in said[0], said


def test_a_long_wait_is_said_on_the_console_with_what_it_waits_for_now(
    buffer, capsys, monkeypatch
) -> None:
    """A trainer run apart (as compose runs it) waited for samples without a word on its
    console: only its status in Redis said so."""
    from services.common import long_wait
    from services.trainer.status import StatusReporter

    monkeypatch.setattr(long_wait, "SAY_EVERY_S", 0.6)
    reporter = StatusReporter(trainer_membership(buffer), interval_s=0.1)
    try:
        reporter.update("waiting for samples", "sample groups: 0 of 4 for step 1")
        time.sleep(0.4)
        reporter.update("waiting for samples", "sample groups: 1 of 4 for step 1")  # one wait
        time.sleep(1.0)
        reporter.update("training")  # no wait: nothing more is said
        time.sleep(1.0)
    finally:
        reporter.close()
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[trainer]")]
    assert 1 <= len(said) <= 3, said
    wait = r"\[trainer\] waiting for samples for \d+ s: waits for sample groups: 1 of 4 for step 1"
    assert all(re.fullmatch(wait, line) for line in said), said


def test_a_closing_trainer_reports_stopping_until_its_teardown_ends(buffer) -> None:
    """Closing can take a minute (the sender's linger for a last version, a bounded teardown
    after a failed weight group): the status says so, kept fresh, and `stopped` only at the
    end. Before, `stopped` was written first, with a TTL that could lapse during the teardown
    (seen on 2x H200: the watchdog said `trainer: no status reported` while it closed)."""
    from services.trainer.status import StatusReporter
    from services.trainer.trainer import Trainer

    seen: list[tuple[str, str]] = []

    class Sender:
        def close(self, linger_s: float) -> None:
            status = buffer.statuses()["trainer"]
            seen.append((status.state, status.waiting_for))

    class Observe:
        def close(self) -> None:
            pass

    trainer = Trainer.__new__(Trainer)
    trainer.status = StatusReporter(trainer_membership(buffer), interval_s=0.2)
    trainer.observe = Observe()
    trainer.sender, trainer.stop_requested, trainer.version = Sender(), False, 3
    trainer.lease = None
    trainer.close()
    assert seen == [("stopping", "its weight sender and process groups to close (<= 45 s)")]
    assert buffer.statuses()["trainer"].state == "stopped" and trainer.status is None
