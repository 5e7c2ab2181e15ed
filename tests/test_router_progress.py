"""The rollout loop's progress rules as plain arithmetic (progress.py) and reward failures
(rewards.py): the demand gate, the prompt order, the backoff, and rewards that fail alone."""

from __future__ import annotations

import asyncio
import math

import pytest

from services.rollout_router.rollout.progress import (
    Backoff,
    Demand,
    EpochOrders,
    allowance,
    closed_gate_reason,
    epoch_order,
)
from services.rollout_router.rollout.rewards import Reward, RewardError


def demand(put: int = 0, consumed: int = 0, in_flight: int = 0, v: int = -1, e: int = 0):
    return Demand(put, consumed, in_flight, trainer_version=v, engines_version=e)


def test_the_gate_allows_max_staleness_plus_one_rollouts_ahead_of_the_trainer():
    # B=4, k=1, s=1: at versions 0/0 the trainer's rollouts 0 and 1 may be made.
    assert allowance(demand(), 4, 1, 1) == 8
    assert allowance(demand(put=5, in_flight=3), 4, 1, 1) == 0
    assert allowance(demand(put=5, in_flight=2), 4, 1, 1) == 1
    # with s=0 only the rollout the trainer fills next
    assert allowance(demand(put=3), 4, 1, 0) == 1


def test_every_group_the_trainer_consumes_or_drops_reopens_the_gate():
    closed = demand(put=8, consumed=0, v=0, e=0)
    assert allowance(closed, 4, 1, 1) == 0
    # the trainer consumed 4 (some of them dropped as stale): 4 replacements, still for rollout 1
    assert allowance(demand(put=8, consumed=4, v=0, e=0), 4, 1, 1) == 4
    # after it steps, the next rollout needs the engines on version >= 1
    stepped = demand(put=8, consumed=4, v=1, e=0)
    assert allowance(stepped, 4, 1, 1) == 0
    assert allowance(demand(put=8, consumed=4, v=1, e=1), 4, 1, 1) == 4


def test_more_consumed_than_put_counts_as_nothing_ahead():
    # a trainer resumed on a fresh Redis: its rollout 5 still needs the engines on version 4
    assert allowance(demand(put=0, consumed=20, v=5, e=0), 4, 1, 1) == 0
    assert allowance(demand(put=0, consumed=20, v=5, e=4), 4, 1, 1) == 4


def test_with_several_steps_per_rollout_the_gate_counts_rollouts_not_steps():
    # k=2: the trainer fills rollout v // 2; rollout r is checked at version 2r
    assert allowance(demand(put=0, v=1, e=0), 4, 2, 1) == 4  # rollout 0 only: 2*1 > 0 + 1
    assert allowance(demand(put=0, v=1, e=1), 4, 2, 1) == 8


def test_a_closed_gate_names_the_engines_when_the_trainer_is_ahead_else_the_trainer():
    ahead = closed_gate_reason(demand(put=0, v=5, e=0), 4, 1, 1)
    assert ahead.startswith("engines on weight version >= 4 (they serve 0)")
    waiting = closed_gate_reason(demand(put=8, consumed=0, v=0, e=0), 4, 1, 1)
    assert waiting == "the trainer to consume groups (put 8, consumed 0, trainer at version 0)"
    absent = closed_gate_reason(demand(put=8, consumed=0, v=-1, e=0), 4, 1, 1)
    assert absent.startswith("the trainer to consume groups (put 8, consumed 0, trainer at")
    assert "no trainer has started on this run" in absent and "--run-id" in absent


def test_each_epoch_visits_every_prompt_once_in_a_seeded_order():
    first = epoch_order(50, seed=1, epoch=0)
    assert sorted(first) == list(range(50))
    assert first == epoch_order(50, seed=1, epoch=0)
    assert first != epoch_order(50, seed=1, epoch=1)
    assert first != epoch_order(50, seed=2, epoch=0)
    orders = EpochOrders()
    assert orders.order(50, 1, 0) is orders.order(50, 1, 0), "computed once per epoch"


def test_backoff_doubles_once_per_wave_up_to_30_s_and_resets_on_success():
    b = Backoff()
    b.failed("env_all_failed", "down", started_at=1.0, now=2.0)
    assert b.delay_s == 0.5 and b.until == 2.5
    b.failed("env_all_failed", "down", started_at=1.5, now=2.1)  # already in flight: same wave
    assert b.delay_s == 0.5 and b.streak == 2
    for t in range(3, 20):
        b.failed("env_all_failed", "down", started_at=float(t), now=float(t))
    assert b.delay_s == 30.0
    assert "19 env_all_failed in a row (down), next try in 8 s" in b.sentence("env", 8.0)
    b.succeeded()
    assert not b.active and b.streak == 0


def raises(text: str, label: str, stopped: bool) -> float:
    raise ZeroDivisionError("boom")


@pytest.mark.parametrize(
    ("fn", "reason", "text"),
    [
        (raises, "reward_error", "raised ZeroDivisionError: boom"),
        (lambda t, lab, s: None, "reward_error", "returned None"),
        (lambda t, lab, s: math.nan, "reward_nonfinite", "returned nan"),
        (lambda t, lab, s: {"score": 1}, "reward_error", "returned {'score': 1}, not a number"),
        # (float("1") is 1.0: the old code took a returned answer for its score)
        (lambda t, lab, s: "1", "reward_error", "returned '1', text: return a number"),
    ],
)
def test_a_failing_reward_fails_its_sample_only_with_its_reason(fn, reason, text):
    reward = Reward(lambda t, lab, s: fn(t, lab, s) if t == "bad" else 1.0)
    out = asyncio.run(reward.score_all("p", [("good", "stop"), ("bad", "stop")], "l"))
    assert out[0] == 1.0
    assert isinstance(out[1], RewardError) and out[1].reason == reason and text in str(out[1])
    assert reward.failures[reason] == 1
