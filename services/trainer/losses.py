"""RL advantages and losses as pure tensor functions (no megatron, no I/O).

Conventions: per-token tensors are 1-D over the response tokens of the samples concerned, laid
out sample after sample; `seq_ids[i]` names the sample of token i (0..n-1). Log-probs are of the
sampled token. "Behaviour" = the engine that sampled (its `response_logprobs`); "proximal" = the
trainer's recomputed log-probs before this step's update (decoupled PPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# --- advantages ---------------------------------------------------------------------------------


def grpo_advantages(
    rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per sample of one group: reward minus group mean, divided by (std + eps) if asked.

    A group of one sample has advantage 0 (it carries no comparison). Dr.GRPO = no std division.
    """
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    centered = rewards - rewards.mean()
    if normalize_std:
        centered = centered / (rewards.std() + eps)
    return centered


def reinforce_pp_advantages(
    group_rewards: list[torch.Tensor], baseline: bool, eps: float = 1e-6
) -> list[torch.Tensor]:
    """REINFORCE++: (optionally group-mean baselined) rewards whitened over the whole batch."""
    centered = [r - r.mean() if baseline else r.clone() for r in group_rewards]
    flat = torch.cat(centered)
    if flat.numel() < 2:
        return centered
    mean, std = flat.mean(), flat.std()
    return [(c - mean) / (std + eps) for c in centered]


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens, `[T]` or a batch `[B, T]`.

    `values[..., t]` is the critic's value before emitting token t; the value after the last
    token is 0 (the episode ends). A batch holds samples right-padded with zero rewards and
    zero values, which leaves every sample's result unchanged. One vector op per time step.
    Returns (advantages, returns = advantages + values).
    """
    next_values = torch.cat([values[..., 1:], torch.zeros_like(values[..., :1])], dim=-1)
    deltas = token_rewards + gamma * next_values - values
    adv = torch.empty_like(deltas)
    last = torch.zeros_like(deltas[..., 0])
    for t in range(deltas.shape[-1] - 1, -1, -1):
        last = deltas[..., t] + gamma * lambd * last
        adv[..., t] = last
    return adv, adv + values


# --- KL estimators ------------------------------------------------------------------------------


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # exp(-x) - 1 + x >= 0; clamp keeps one wild token from dominating.
        return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}: use k1, k2 or k3")


# --- policy loss --------------------------------------------------------------------------------


@dataclass
class PolicyLossConfig:
    """The subset of `TrainerConfig` the policy loss reads."""

    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    eps_clip_c: float = 0.0
    policy_loss_type: str = "ppo"  # or "gspo"
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    decoupled_ppo: bool = False


def segment_mean(
    values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted per-sample mean of per-token values -> [num_seqs]."""
    sums = values.new_zeros(num_seqs).index_add(0, seq_ids, values * weights)
    counts = weights.new_zeros(num_seqs).index_add(0, seq_ids, weights)
    return sums / counts.clamp(min=1e-8)


def policy_loss(
    cfg: PolicyLossConfig,
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    proximal_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss (to be aggregated by the caller) and per-token stats.

    Ratio base: the behaviour (engine) log-probs, or with `decoupled_ppo` the proximal ones,
    in which case the loss is also weighted by pi_prox / pi_behaviour truncated to
    [tis_clip_low, tis_clip]. With
    `use_tis` the loss is weighted by min(pi_prox / pi_behaviour, tis_clip) (TIS). GSPO uses the
    per-sample geometric-mean ratio with token-level gradients.
    """
    anchor = proximal_logp if cfg.decoupled_ppo and proximal_logp is not None else behaviour_logp
    log_ratio = logp - anchor
    if cfg.policy_loss_type == "gspo":
        seq_log_ratio = segment_mean(log_ratio, seq_ids, num_seqs, mask)
        log_ratio = seq_log_ratio.detach()[seq_ids] + logp - logp.detach()
    elif cfg.policy_loss_type != "ppo":
        raise ValueError(f"unknown policy_loss_type {cfg.policy_loss_type!r}")
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped)
    clipfrac = (-advantages * clipped > -advantages * ratio).float()
    if cfg.eps_clip_c > 1.0:
        dual = -advantages * cfg.eps_clip_c
        loss = torch.where(advantages < 0, torch.minimum(loss, dual), loss)
    stats = {"clipfrac": clipfrac, "approx_kl": (0.5 * log_ratio.square()).detach()}
    if proximal_logp is not None and (cfg.use_tis or cfg.decoupled_ppo):
        # Truncated in both cases: an unbounded ratio lets one token dominate the step.
        is_weight = torch.exp(proximal_logp - behaviour_logp).detach()
        is_weight = is_weight.clamp(min=cfg.tis_clip_low, max=cfg.tis_clip)
        loss = loss * is_weight
        stats["is_weight"] = is_weight
    return loss, stats


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    mode: str,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of the step's loss; summed over micro-batches and ranks first,
    divided last, so every aggregation is exact under any micro-batching.

    token_mean: sum over tokens / tokens; seq_mean_token_mean: sum of per-sample means / samples;
    seq_mean_token_sum_norm (Dr.GRPO): sum over tokens / (samples * max_len).
    """
    if mode == "token_mean":
        return (token_loss * mask).sum(), mask.sum()
    if mode == "seq_mean_token_mean":
        return segment_mean(token_loss, seq_ids, num_seqs, mask).sum(), mask.new_tensor(
            float(num_seqs)
        )
    if mode == "seq_mean_token_sum_norm":
        return (token_loss * mask).sum(), mask.new_tensor(float(num_seqs * max_len))
    raise ValueError(f"unknown loss_aggregation {mode!r}")
