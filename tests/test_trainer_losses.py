"""Unit tests of the trainer's pure RL math: advantages, policy loss, aggregation, KL."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer import losses


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over one sample's response tokens."""
    out = torch.empty_like(token_rewards)
    running = token_rewards.new_zeros(())
    for t in range(token_rewards.numel() - 1, -1, -1):
        running = token_rewards[t] + gamma * running
        out[t] = running
    return out


def test_grpo_advantage_is_reward_minus_group_mean_over_std() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    adv = losses.grpo_advantages(r, normalize_std=True, eps=0.0)
    std = r.std()  # unbiased, as torch computes it
    assert torch.allclose(adv, (r - 0.5) / std)
    assert torch.allclose(losses.grpo_advantages(r, normalize_std=False), r - 0.5)


def test_grpo_advantage_of_a_group_with_equal_rewards_is_zero_not_nan() -> None:
    adv = losses.grpo_advantages(torch.tensor([0.3, 0.3, 0.3]), normalize_std=True, eps=1e-6)
    assert torch.equal(adv, torch.zeros(3))
    assert torch.equal(losses.grpo_advantages(torch.tensor([0.7])), torch.zeros(1))


def test_reinforce_pp_with_baseline_whitens_group_centred_rewards_over_the_batch() -> None:
    groups = [torch.tensor([1.0, 0.0]), torch.tensor([2.0, 2.0, 5.0])]
    out = losses.reinforce_pp_advantages(groups, baseline=True, eps=0.0)
    flat = torch.cat([groups[0] - 0.5, groups[1] - 3.0])
    expected = (flat - flat.mean()) / flat.std()
    assert torch.allclose(torch.cat(out), expected)


def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return() -> None:
    rewards = torch.tensor([0.0, 0.0, 1.0])
    adv, ret = losses.gae(rewards, torch.zeros(3), gamma=0.5, lambd=1.0)
    assert torch.allclose(adv, torch.tensor([0.25, 0.5, 1.0]))
    assert torch.allclose(discounted_returns(rewards, 0.5), ret)


def test_gae_subtracts_the_critic_value() -> None:
    adv, ret = losses.gae(torch.tensor([1.0]), torch.tensor([0.4]), gamma=1.0, lambd=0.9)
    assert torch.allclose(adv, torch.tensor([0.6])) and torch.allclose(ret, torch.tensor([1.0]))


def _loss(cfg: losses.PolicyLossConfig, logp, old, adv, prox=None):  # type: ignore[no-untyped-def]
    n = len(logp)
    return losses.policy_loss(
        cfg,
        torch.tensor(logp),
        torch.tensor(old),
        torch.tensor(adv),
        torch.ones(n),
        torch.zeros(n, dtype=torch.long),
        1,
        None if prox is None else torch.tensor(prox),
    )


def test_clipped_loss_matches_hand_computed_values() -> None:
    cfg = losses.PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28)
    # ratio 1.5 with positive advantage: clipped at 1.28 -> loss -1.28 * 2
    # ratio 0.5 with positive advantage: unclipped (min of the two objectives) -> -0.5 * 2
    # ratio 0.5 with negative advantage: clipped at 0.8 -> +0.8
    # ratio 1.0: -adv
    logp = [math.log(1.5), math.log(0.5), math.log(0.5), 0.0]
    loss, stats = _loss(cfg, logp, [0.0] * 4, [2.0, 2.0, -1.0, 3.0])
    assert torch.allclose(loss, torch.tensor([-2.56, -1.0, 0.8, -3.0]), atol=1e-6)
    assert stats["clipfrac"].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_clipped_loss_gradient_is_zero_where_clipped() -> None:
    cfg = losses.PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.2)
    logp = torch.tensor([math.log(1.5), 0.0], requires_grad=True)
    loss, _ = losses.policy_loss(
        cfg,
        logp,
        torch.zeros(2),
        torch.tensor([1.0, 1.0]),
        torch.ones(2),
        torch.zeros(2, dtype=torch.long),
        1,
    )
    loss.sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([0.0, -1.0])


def test_dual_clip_bounds_the_loss_of_negative_advantages() -> None:
    cfg = losses.PolicyLossConfig(eps_clip_c=3.0)
    loss, _ = _loss(cfg, [math.log(10.0)], [0.0], [-1.0])
    assert loss.item() == pytest.approx(3.0)


def test_tis_weights_the_loss_by_the_truncated_trainer_to_engine_ratio() -> None:
    cfg = losses.PolicyLossConfig(use_tis=True, tis_clip=2.0)
    # proximal/behaviour = e^2 > 2 -> weight 2; ratio vs behaviour = 1 at logp == behaviour
    loss, stats = _loss(cfg, [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], prox=[2.0, math.log(0.5)])
    assert torch.allclose(stats["is_weight"], torch.tensor([2.0, 0.5]))
    assert torch.allclose(loss, torch.tensor([-2.0, -0.5]))


def test_decoupled_ppo_clips_against_the_proximal_policy() -> None:
    cfg = losses.PolicyLossConfig(
        decoupled_ppo=True, eps_clip=0.2, eps_clip_high=0.2, tis_clip=10.0
    )
    # logp == proximal -> ratio 1 (unclipped) even though behaviour is far away; weight e^1.
    loss, stats = _loss(cfg, [1.0], [0.0], [1.0], prox=[1.0])
    assert stats["clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx(-math.e, rel=1e-6)


def test_gspo_uses_one_geometric_mean_ratio_per_sequence() -> None:
    cfg = losses.PolicyLossConfig(policy_loss_type="gspo", eps_clip=0.5, eps_clip_high=0.5)
    logp = torch.tensor([math.log(2.0), 0.0, 0.0])
    seq = torch.tensor([0, 0, 1])
    loss, _ = losses.policy_loss(cfg, logp, torch.zeros(3), torch.ones(3), torch.ones(3), seq, 2)
    ratio0 = math.sqrt(2.0)  # exp(mean(log 2, 0))
    assert loss.tolist() == pytest.approx([-ratio0, -ratio0, -1.0])


def test_aggregations_give_token_mean_sequence_mean_and_dr_grpo_normalisation() -> None:
    token_loss = torch.tensor([1.0, 2.0, 3.0, 10.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    seq = torch.tensor([0, 0, 1, 1])
    num, den = losses.aggregate(token_loss, mask, seq, 2, "token_mean", 4)
    assert (num / den).item() == pytest.approx(2.0)
    num, den = losses.aggregate(token_loss, mask, seq, 2, "seq_mean_token_mean", 4)
    assert (num / den).item() == pytest.approx((1.5 + 3.0) / 2)
    num, den = losses.aggregate(token_loss, mask, seq, 2, "seq_mean_token_sum_norm", 4)
    assert (num / den).item() == pytest.approx(6.0 / 8)


def test_kl_estimators_k1_k2_k3() -> None:
    logp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])
    x = math.log(2.0)
    assert losses.kl_estimate(logp, ref, "k1").item() == pytest.approx(x)
    assert losses.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * x * x)
    assert losses.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + x)
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        losses.kl_estimate(logp, ref, "k9")


def test_batched_gae_of_right_padded_samples_equals_gae_of_each_sample() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 5, 1]
    rewards = [torch.randn(n, generator=gen) for n in lengths]
    values = [torch.randn(n, generator=gen) for n in lengths]
    block_r, block_v = torch.zeros(3, 5), torch.zeros(3, 5)
    for i, n in enumerate(lengths):
        block_r[i, :n], block_v[i, :n] = rewards[i], values[i]
    adv, ret = losses.gae(block_r, block_v, gamma=0.9, lambd=0.8)
    for i, n in enumerate(lengths):
        a, r = losses.gae(rewards[i], values[i], gamma=0.9, lambd=0.8)
        assert torch.allclose(adv[i, :n], a) and torch.allclose(ret[i, :n], r)
