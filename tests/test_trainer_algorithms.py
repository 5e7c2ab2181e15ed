"""Process tests of the loss options and of non-finite updates (real trainer CLI, real Valkey)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.test_trainer_process import common_args, run_trainer, sample_groups


def metrics_of(buffer) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    return [r.values for _, r in buffer.read_metrics() if r.source == "trainer"]


@pytest.mark.parametrize(
    "flags",
    [
        [
            "--use-tis",
            "--policy-loss-type",
            "gspo",
            "--entropy-coef",
            "0.01",
            "--kl-coef",
            "0.1",
            "--kl-loss-type",
            "k3",
            "--loss-aggregation",
            "seq_mean_token_mean",
        ],
        [
            "--decoupled-ppo",
            "--kl-coef",
            "0.1",
            "--no-use-kl-loss",
            "--advantage-estimator",
            "reinforce_plus_plus_baseline",
            "--eps-clip-high",
            "0.28",
            "--eps-clip-c",
            "3",
            "--loss-aggregation",
            "seq_mean_token_sum_norm",
        ],
    ],
    ids=["tis_gspo_entropy_kl_loss", "decoupled_kl_reward_reinforce_pp"],
)
def test_loss_options_train_a_step_and_report_their_metrics(
    buffer, toy_model_dir: Path, flags: list[str]
) -> None:
    for g in sample_groups(toy_model_dir, 4, 4, seed=7):
        buffer.put_group(g)
    args = [
        *common_args(toy_model_dir, buffer),
        "--max-steps",
        "1",
        "--ref-load",
        str(toy_model_dir),
    ]
    done = run_trainer([*args, *flags])
    assert done.returncode == 0, done.stderr[-3000:]
    (values,) = metrics_of(buffer)
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/entropy",
        "train/clipfrac",
        "train/approx_kl",
        "train/mismatch_kl",
        "train/is_weight_mean",
        "train/packing_efficiency",
    ):
        assert math.isfinite(values[key]), key
    # same weights at step 0: trainer and engine agree, so IS weights are ~1
    assert values["train/is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    assert values["train/staleness_hist/0"] == 16
    if "--no-use-kl-loss" not in flags:
        assert values["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # ref == policy at step 0


def test_a_non_finite_update_is_skipped_and_counted_or_fails_when_asked(
    buffer, toy_model_dir: Path
) -> None:
    groups = sample_groups(toy_model_dir, 4, 4, seed=8)
    groups[0].samples[0].response_logprobs[0] = float("nan")
    for g in groups:
        buffer.put_group(g)
    done = run_trainer([*common_args(toy_model_dir, buffer), "--max-steps", "1"])
    assert done.returncode == 1, done.stderr[-3000:]  # its only update was skipped: no success
    assert "every update of this run was skipped (1 steps)" in done.stderr
    (values,) = metrics_of(buffer)
    assert values["train/skipped_updates"] == 1 and values["train/update_skipped"] == 1
    assert not math.isfinite(values["train/grad_norm"])

    for key in buffer.redis.scan_iter(f"tandem:{buffer.config.run_id}:*"):
        buffer.redis.delete(
            key
        )  # a new run: a start without checkpoint on a trained run is refused
    for g in groups:
        buffer.put_group(g)
    done = run_trainer(
        [*common_args(toy_model_dir, buffer), "--max-steps", "1", "--on-nonfinite", "fail"]
    )
    assert done.returncode == 1
    assert "non-finite gradient" in done.stderr


def test_ppo_with_a_critic_trains_policy_and_value_model(buffer, toy_model_dir: Path) -> None:
    for g in sample_groups(toy_model_dir, 8, 4, seed=9):
        buffer.put_group(g)
    args = [
        *common_args(toy_model_dir, buffer),
        "--max-steps",
        "2",
        "--advantage-estimator",
        "gae",
        "--lambd",
        "0.95",
        "--critic-lr",
        "1e-2",
    ]
    done = run_trainer(args)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = metrics_of(buffer)
    assert first["train/value_mean"] == 0.0  # zero-initialised value head
    assert second["train/value_mean"] != 0.0  # the critic learned something in step 1
    assert math.isfinite(first["train/value_loss"]) and first["train/critic_grad_norm"] > 0
    assert math.isfinite(second["train/loss"])


def test_gae_with_tensor_parallelism_is_refused_at_start(toy_model_dir: Path) -> None:
    done = run_trainer(
        [
            "--model",
            str(toy_model_dir),
            "--advantage-estimator",
            "gae",
            "--tensor-model-parallel-size",
            "2",
        ]
    )
    assert done.returncode == 2 and "--tensor-model-parallel-size 1" in done.stderr


def test_a_sample_longer_than_the_token_budget_is_dead_lettered_naming_the_flag(
    buffer, toy_model_dir: Path
) -> None:
    long = sample_groups(toy_model_dir, 1, 4, seed=12)[0]
    long.group_id = "long"
    long.samples[0].response_ids = [5] * 12  # 4 prompt + 12 response tokens
    long.samples[0].response_logprobs = [-1.0] * 12
    long.samples[0].loss_mask = [1] * 12
    for g in [long, *sample_groups(toy_model_dir, 4, 4, seed=10)]:  # at most 8 tokens each
        buffer.put_group(g)
    done = run_trainer(
        [*common_args(toy_model_dir, buffer), "--max-steps", "1", "--max-tokens-per-gpu", "8"]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (letter,) = buffer.dead_letters()
    assert letter.reason == "too_long" and "--max-tokens-per-gpu" in letter.detail
    assert "4 prompt + 12 response tokens" in letter.detail
    assert buffer.trained() == {1: ["g0", "g1", "g2", "g3"]}
    assert buffer.depth() == 0


def test_bf16_training_with_fp32_master_weights_runs_and_stays_close_to_the_engine(
    buffer, toy_model_dir: Path
) -> None:
    for g in sample_groups(toy_model_dir, 4, 4, seed=11):
        buffer.put_group(g)
    done = run_trainer([*common_args(toy_model_dir, buffer), "--max-steps", "1", "--bf16"])
    assert done.returncode == 0, done.stderr[-3000:]
    (values,) = metrics_of(buffer)
    assert 0 < values["train/logprob_abs_diff_max"] < 2e-2  # bf16 rounding, not a wrong model
    assert math.isfinite(values["train/loss"]) and values["train/skipped_updates"] == 0


def test_skipping_the_recompute_pass_trains_exactly_as_recomputing(
    buffer, toy_model_dir: Path
) -> None:
    """`--recompute-logprobs auto` takes the proximal log-probs, mismatch and entropy metrics
    from the training forward; two steps must match the separate pass's (`always`) run."""
    groups = sample_groups(toy_model_dir, 8, 4, seed=11)
    flags = ["--max-steps", "2", "--decoupled-ppo", "--use-tis", "--entropy-coef", "0.01"]
    runs = []
    for mode in ("always", "auto"):
        for key in buffer.redis.scan_iter(f"tandem:{buffer.config.run_id}:*"):
            if not key.endswith(b":metrics"):  # a new run on the same buffer, from --model
                buffer.redis.delete(key)
        for g in groups:
            buffer.put_group(g)
        before = len(metrics_of(buffer))
        done = run_trainer(
            [*common_args(toy_model_dir, buffer), *flags, "--recompute-logprobs", mode]
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(metrics_of(buffer)[before:])
    always, auto = runs
    assert len(always) == len(auto) == 2
    for a, b in zip(always, auto, strict=True):
        for key in (
            "train/loss",
            "train/grad_norm",
            "train/entropy",
            "train/mismatch_kl",
            "train/logprob_abs_diff_max",
            "train/is_weight_mean",
            "train/is_weight_max",
            "train/clipfrac",
            "train/approx_kl",
        ):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6, nan_ok=True), key
    assert all(math.isfinite(v) for v in always[0].values())
    # step 2 trains version-0 samples at version 1: no same-version sample to compare
    assert math.isnan(always[1]["train/logprob_abs_diff_max"])
    # the second step trained on weights that the first changed: the runs did train
    assert always[1]["train/loss"] != always[0]["train/loss"]
