"""Unit tests of the trainer's data path: staleness filter, advantages per token, packing."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from proto import Sample, SampleGroup
from proto.packed import pack
from services.common.settings import ConfigError, resolve
from services.trainer import batching
from services.trainer.config import TrainerConfig
from tests.helpers import run_bench


def group(version: int, rewards: list[float], response_len: int = 2, gid: str = "g") -> SampleGroup:
    samples = [
        Sample(
            prompt_ids=[1, 5, 6, 14],
            response_ids=[7] * response_len,
            response_logprobs=[-0.5] * response_len,
            loss_mask=[1] * response_len,
            reward=r,
            weight_version=version,
        )
        for r in rewards
    ]
    return SampleGroup(
        group_id=gid,
        prompt="12>",
        label="21",
        samples=samples,
        weight_version=version,
        created_at=0.0,
    )


def test_a_group_more_than_max_staleness_versions_old_is_stale() -> None:
    groups = [("a", group(5, [0.0])), ("b", group(4, [0.0])), ("c", group(3, [0.0]))]
    fresh, stale = batching.split_stale(groups, version=5, max_staleness=1)
    assert [g[0] for g in fresh] == ["a", "b"]
    assert [g[0] for g in stale] == ["c"]
    fresh, stale = batching.split_stale(groups, version=5, max_staleness=0)
    assert [g[0] for g in stale] == ["b", "c"]


def test_grpo_advantages_are_broadcast_to_every_response_token() -> None:
    adv = batching.compute_advantages([group(0, [1.0, 0.0], response_len=3)], "grpo", True, 0.0)
    std = torch.tensor([1.0, 0.0], dtype=torch.float64).std().item()
    assert [[t.tolist() for t in g] for g in adv] == [
        [[pytest.approx(0.5 / std)] * 3, [pytest.approx(-0.5 / std)] * 3]
    ]
    dr = batching.compute_advantages([group(0, [1.0, 0.0])], "dr_grpo", True, 0.0)
    assert [[t.tolist() for t in g] for g in dr] == [[[0.5, 0.5], [-0.5, -0.5]]]
    three = [group(0, [1.0, 0.0], response_len=3)]
    flat = batching.compute_advantages(three, "reinforce_plus_plus", False, 0.0)
    discounted = batching.compute_advantages(three, "reinforce_plus_plus", False, 0.0, gamma=0.5)
    for const, disc in zip(flat[0], discounted[0], strict=True):  # back from the last token
        assert disc.tolist() == pytest.approx([float(const[0]) * k for k in (0.25, 0.5, 1.0)])


def test_first_fit_decreasing_respects_the_budget_and_keeps_every_sample() -> None:
    lengths = [7, 3, 5, 2, 8, 1, 4]
    bins = batching.pack_first_fit(lengths, budget=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 30 tokens, budget 10: optimal


def test_a_sample_longer_than_the_budget_names_the_flag_to_raise() -> None:
    with pytest.raises(batching.SampleTooLongError, match="--max-tokens-per-gpu 8"):
        batching.pack_first_fit([3, 9], budget=8)


def test_packed_micro_batch_has_cu_seqlens_and_loss_only_on_response_tokens() -> None:
    groups = [group(0, [1.0, 0.0], response_len=2), group(0, [0.5], response_len=3)]
    samples = batching.flatten(groups, batching.compute_advantages(groups, "dr_grpo", False, 0.0))
    mb = batching.build_micro_batch(samples, [0, 2], packed=True)
    # sample 0: 4 prompt + 2 response -> 5 inputs; sample 2: 4 + 3 -> 6 inputs
    assert mb.packed_seq_params is not None
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 11]
    assert mb.input_ids.shape == (1, 11)
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert mb.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert mb.targets[0, 3].item() == 7 and mb.input_ids[0, 3].item() == 14


def test_padded_micro_batch_marks_padding_with_sequence_id_minus_one() -> None:
    groups = [group(0, [1.0], response_len=1), group(0, [0.0], response_len=3)]
    samples = batching.flatten(groups, batching.compute_advantages(groups, "grpo", True, 0.0))
    mb = batching.build_micro_batch(samples, [0, 1], packed=False)
    assert mb.input_ids.shape == (2, 6)
    assert mb.seq_ids[0].tolist() == [0, 0, 0, 0, -1, -1]
    assert mb.loss_mask[0].tolist() == [0, 0, 0, 1, 0, 0]
    assert mb.num_tokens == 10


def test_packed_groups_make_the_same_micro_batches_as_lists() -> None:
    """The trainer reads groups packed as bytes (proto/packed.py): their micro-batches, packed
    and padded, hold exactly what the list form gives, masked tokens and log-probs included."""
    groups = [group(0, [1.0, 0.0], response_len=3), group(0, [0.5], response_len=2)]
    first = groups[0].samples[0]
    first.loss_mask, first.response_ids = [1, 0, 1], [7, 15, 3]
    first.response_logprobs = [-0.25, -1.5, -0.125]
    packed = [pack(g) for g in groups]  # (the first's mask stored, the others' stored empty)
    assert packed[0].samples[0].mask and not packed[0].samples[1].mask
    adv = batching.compute_advantages(groups, "grpo", True, 0.0)
    again = batching.compute_advantages(packed, "grpo", True, 0.0)
    assert all(map(np.array_equal, [t for g in adv for t in g], [t for g in again for t in g]))
    lists, arrays = batching.flatten(groups, adv), batching.flatten(packed, adv)
    for as_packed in (True, False):
        want = batching.build_micro_batch(lists, [0, 1, 2], packed=as_packed)
        got = batching.build_micro_batch(arrays, [0, 1, 2], packed=as_packed)
        for name in ("input_ids", "position_ids", "targets", "seq_ids", "loss_mask"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(got.behaviour_logp, want.behaviour_logp)
        assert torch.equal(got.advantages, want.advantages)
        assert got.response_spans == want.response_spans
    mb = batching.build_micro_batch(arrays, [0], packed=True)
    assert mb.targets[0].tolist() == [5, 6, 14, 7, 15, 3]
    assert mb.loss_mask[0].tolist() == [0, 0, 0, 1, 0, 1]
    assert mb.behaviour_logp[0].tolist() == [0, 0, 0, -0.25, -1.5, -0.125]


def test_batch_arithmetic_is_validated_with_the_flags_to_change() -> None:
    cfg = TrainerConfig(
        model="m", rollout_batch_size=4, n_samples_per_prompt=3, num_steps_per_rollout=5
    )
    with pytest.raises(ValueError, match="--num-steps-per-rollout 5"):
        cfg.validate()
    cfg = TrainerConfig(model="m", rollout_batch_size=3, n_samples_per_prompt=1)
    with pytest.raises(ValueError, match=r"its advantage \(reward minus the group's mean\) is 0"):
        cfg.validate()  # GRPO's baseline is the group's mean: a group of one learns nothing
    cfg.loss.advantage_estimator = "reinforce_plus_plus"  # (its baseline is the batch's)
    with pytest.raises(ValueError, match="data-parallel size 2"):
        cfg.validate(dp_size=2)
    with pytest.raises(ValueError, match="save_interval"):
        TrainerConfig(model="m", save_interval=-1).validate()
    cfg = TrainerConfig(model="m", lr_decay_style="cosine")
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        cfg.validate()
    assert TrainerConfig(model="m", num_steps_per_rollout=2).global_batch_size == 256


def test_the_batch_prep_bench_runs_and_ends_with_its_ratio() -> None:
    small = ["--groups", "2", "--samples", "2", "--prompt-len", "8", "--response-len", "16"]
    lines = run_bench("batch_prep.py", *small, "--runs", "1")
    assert lines[0] == "tokens: 96 (2 groups x 2 samples)"
    assert re.fullmatch(r"batch_prep_vs_copy: \d+\.\d", lines[-1]), lines[-1]


def test_numbers_outside_their_range_are_refused_naming_the_flag() -> None:
    """A negative KL or weight decay, a discount above 1, zero threads or clip: each failed
    only once the trainer ran (or ran on, doing nothing sensible), or named another rule."""
    at_least, above = "must be at least", "must be more than"
    cases = {
        "kl_coef": ("-1.0", f"--kl-coef -1.0: {at_least} 0"),
        "gamma": ("2.0", "--gamma 2.0: must be at most 1"),
        "eps_clip": ("0.0", f"--eps-clip 0.0: {above} 0"),
        "num_threads": ("0", f"--num-threads 0: {at_least} 1"),
        "micro_batch_size": ("0", f"--micro-batch-size 0: {at_least} 1"),
        "lr": ("nan", "--lr nan: not a finite number"),
        "tis_clip": ("-3.0", f"--tis-clip -3.0: {above} 0"),  # (these took -3)
        "value_clip": ("-3.0", f"--value-clip -3.0: {at_least} 0"),
        # (0: equal rewards gave NaN advantages; Redis reads BLOCK 0 for good; a division by 0)
        "advantage_eps": ("0.0", f"--advantage-eps 0.0: {above} 0"),
        "read_block_ms": ("0", f"--read-block-ms 0: {at_least} 1"),
        "make_vocab_size_divisible_by": ("0", f"--make-vocab-size-divisible-by 0: {at_least} 1"),
        "tensor_model_parallel_size": ("0", f"--tensor-model-parallel-size 0: {at_least} 1"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(ConfigError) as refused:
            resolve(
                TrainerConfig, ["--model", "m", f"--{name.replace('_', '-')}", value], "trainer"
            )
        assert str(refused.value) == message
    TrainerConfig(model="m", gamma=1.0, clip_grad=0.0, lambd=0.95).validate()


def test_groups_whose_samples_scored_the_same_are_counted_under_a_group_relative_advantage() -> (
    None
):
    """Their advantages are 0: a step of only such groups teaches nothing (tandem up says so
    after a streak: tests/test_up_console.py)."""
    from services.trainer.stats import StepStats
    from services.trainer.step_math import metrics_from

    def sample(group: int, reward: float) -> batching.TrainSample:
        zeros = np.zeros(2, np.float32)
        tokens = np.array([1, 2, 3], np.int64)
        return batching.TrainSample(tokens, 1, zeros, zeros + 1, zeros, 0, reward, group=group)

    samples = [sample(0, 1.0), sample(0, 1.0), sample(1, 0.0), sample(1, 1.0), sample(2, 0.0)]
    assert metrics_from(StepStats(), samples, 1, "grpo")["train/groups_one_reward"] == 2 / 3
    assert "train/groups_one_reward" not in metrics_from(StepStats(), samples, 1, "gae")
