"""What one training step computes on micro-batch tensors: the loss function handed to megatron,
the engine/trainer mismatch statistics, and the step's `train/*` metrics.

Pure tensor code over `batching.MicroBatch`; megatron calls `LossFunction` once per micro-batch.
"""

from __future__ import annotations

import math

import torch

from services.trainer import losses
from services.trainer.batching import MicroBatch, TrainSample
from services.trainer.config import GROUP_BASELINED, TrainerConfig
from services.trainer.stats import StepStats


class LossFunction:
    """(micro-batch, log-probs, entropy) -> (loss numerator, integer denominator, {}).

    Megatron sums numerators and denominators over micro-batches and data-parallel ranks and
    divides the gradients once, so the step's loss is exactly the configured aggregation.

    A micro-batch without `proximal_logp` (no separate recompute pass, see the trainer's
    `recompute_logprobs`) takes this forward's log-probs, detached, as the proximal policy: the
    weights before this step's update, the same values the recompute pass would give. Its
    mismatch and entropy metrics are then recorded here, from `samples` (this rank's samples
    of the step) and the trainer's `version`.
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        loss_cfg: losses.PolicyLossConfig,
        max_len: int,
        stats: StepStats,
        samples: list[TrainSample] | None = None,
        version: int = 0,
    ) -> None:
        self.cfg, self.loss_cfg, self.max_len, self.stats = cfg, loss_cfg, max_len, stats
        self.samples, self.version = samples, version
        if samples is not None:
            stats.peak("lp_diff", -math.inf)

    def __call__(
        self, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        dev = logp.device
        if mb.padding:  # no loss; the zero keeps the backward (and its collectives) running
            return logp.sum() * 0.0, torch.zeros((), dtype=torch.int, device=dev), {}
        mask = mb.loss_mask.to(dev).flatten()
        seq = mb.seq_ids.clamp(min=0).to(dev).flatten()
        lp = logp.flatten()
        if mb.proximal_logp is not None:
            proximal = mb.proximal_logp.to(dev).flatten()
        else:
            proximal = lp.detach()
            if self.samples is not None:
                versions = [self.samples[i].weight_version for i in mb.sample_index]
                ent = entropy.detach() if entropy is not None else None
                mismatch_stats_one(mb, proximal, ent, versions, self.version, self.stats)
        token_loss, tstats = losses.policy_loss(
            self.loss_cfg,
            lp,
            mb.behaviour_logp.to(dev).flatten(),
            mb.advantages.to(dev).flatten(),
            mask,
            seq,
            mb.num_seqs,
            proximal_logp=proximal,
        )
        if self.cfg.loss.entropy_coef and entropy is not None:
            token_loss = token_loss - self.cfg.loss.entropy_coef * entropy.flatten()
        if self.cfg.loss.kl_coef and self.cfg.loss.use_kl_loss and mb.ref_logp is not None:
            kl = losses.kl_estimate(lp, mb.ref_logp.to(dev).flatten(), self.cfg.loss.kl_loss_type)
            token_loss = token_loss + self.cfg.loss.kl_coef * kl
            self.stats.add("kl_ref", (kl.detach() * mask).sum(), mask.sum())
        num, den = losses.aggregate(
            token_loss, mask, seq, mb.num_seqs, self.cfg.loss.loss_aggregation, self.max_len
        )
        s = self.stats
        s.count("loss_num", num.detach())
        s.count("loss_den", den)
        s.add("clipfrac", (tstats["clipfrac"] * mask).sum(), mask.sum())
        s.add("approx_kl", (tstats["approx_kl"] * mask).sum(), mask.sum())
        if "is_weight" in tstats:
            w, on = tstats["is_weight"].detach(), mask > 0
            s.add("is_weight", (w * mask).sum(), mask.sum())
            s.peak("is_weight_max", torch.where(on, w, -math.inf).max())
            s.peak("is_weight_neg_min", torch.where(on, -w, -math.inf).max())
        s.count("nonfinite_loss", (~torch.isfinite(num.detach())).double())
        return num, den.round().to(torch.int), {}


def mismatch_stats(
    mbs: list[MicroBatch], samples: list[TrainSample], version: int, stats: StepStats
) -> None:
    """|engine - trainer| log-prob max over same-version samples; mismatch KL; entropy."""
    stats.peak("lp_diff", -math.inf)
    for mb in (mb for mb in mbs if not mb.padding):
        versions = [samples[i].weight_version for i in mb.sample_index]
        assert mb.proximal_logp is not None, "mismatch_stats runs after the recompute"
        mismatch_stats_one(mb, mb.proximal_logp, mb.entropy, versions, version, stats)


def mismatch_stats_one(
    mb: MicroBatch,
    proximal: torch.Tensor,
    entropy: torch.Tensor | None,
    sample_versions: list[int],
    version: int,
    stats: StepStats,
) -> None:
    """`mismatch_stats` of one micro-batch, on the device of `proximal`, without a host sync."""
    dev = proximal.device
    mask = mb.loss_mask.to(dev).flatten() > 0
    seq = mb.seq_ids.clamp(min=0).to(dev).flatten()
    same = torch.tensor([v == version for v in sample_versions]).to(dev, non_blocking=True)[seq]
    diff = proximal.flatten() - mb.behaviour_logp.to(dev).flatten()
    stats.peak("lp_diff", torch.where(mask & same, diff.abs(), -math.inf).max())
    # KL(engine || trainer) from engine samples, k3 estimator: exp(r) - 1 - r, r = log pt/pe.
    r = torch.where(mask, diff, 0.0)
    stats.add("mismatch_kl", (torch.exp(r) - 1 - r).sum(), mask.sum())
    if entropy is not None:
        stats.add("entropy", (entropy.to(dev).flatten() * mask).sum(), mask.sum())


def apply_kl_reward_penalty(mbs: list[MicroBatch], kl_coef: float, kind: str) -> None:
    """KL as a reward penalty: per-token advantages -= kl_coef * KL(trainer || ref)."""
    for mb in mbs:
        assert mb.proximal_logp is not None and mb.ref_logp is not None, "recomputed first"
        kl = losses.kl_estimate(mb.proximal_logp, mb.ref_logp, kind)
        mb.advantages = mb.advantages - kl_coef * kl * mb.loss_mask


def batch_stats(
    mbs: list[MicroBatch], samples: list[TrainSample], budget: int, stats: StepStats
) -> None:
    """Token counts and packing efficiency (real tokens / tokens the micro-batches occupy)."""
    mbs = [mb for mb in mbs if not mb.padding]
    real = sum(mb.num_tokens for mb in mbs)
    stats.count("tokens", real)
    stats.count("response_tokens", sum(float(mb.loss_mask.sum()) for mb in mbs))
    packed = bool(mbs) and mbs[0].packed_seq_params is not None
    occupied = len(mbs) * budget if packed else sum(mb.input_ids.numel() for mb in mbs)
    stats.count("occupied_tokens", occupied)
    stats.count("micro_batches", len(mbs))


def metrics_from(
    stats: StepStats, samples: list[TrainSample], version: int, estimator: str = ""
) -> dict[str, float]:
    """`train/*` metrics of one step. `samples` is the whole step (all ranks). With a
    group-relative `estimator`, `train/groups_one_reward`: the fraction of the step's groups
    whose samples all scored the same, so that their advantages are 0 (no signal)."""
    ages = [version - s.weight_version for s in samples] or [0]
    s = stats.sums
    metrics = {
        "train/loss": s["loss_num"] / s["loss_den"] if s.get("loss_den") else math.nan,
        "train/reward_mean": sum(x.reward for x in samples) / max(len(samples), 1),
        "train/staleness_mean": sum(ages) / len(ages),
        "train/staleness_max": float(max(ages)),
        "train/logprob_abs_diff_max": stats.max("lp_diff"),
        "train/samples": float(len(samples)),
        "train/tokens": s.get("tokens", 0.0),
        "train/response_tokens": s.get("response_tokens", 0.0),
        "train/micro_batches": s.get("micro_batches", 0.0),
        "train/packing_efficiency": s.get("tokens", 0.0) / max(s.get("occupied_tokens", 0.0), 1.0),
        "train/clipfrac": stats.mean("clipfrac"),
        "train/approx_kl": stats.mean("approx_kl"),
        "train/mismatch_kl": stats.mean("mismatch_kl"),
        "train/entropy": stats.mean("entropy"),
        "train/nonfinite_loss": s.get("nonfinite_loss", 0.0),
    }
    if estimator in GROUP_BASELINED:
        rewards: dict[int, set[float]] = {}
        for x in samples:
            rewards.setdefault(x.group, set()).add(x.reward)
        one = sum(len(r) == 1 for r in rewards.values())
        metrics["train/groups_one_reward"] = one / max(len(rewards), 1)
    if "routing_replay:count" in s:  # fraction of micro-batches routed as the engine did
        metrics["train/routing_replay_fraction"] = stats.mean("routing_replay")
    if "is_weight:count" in s:
        metrics["train/is_weight_mean"] = stats.mean("is_weight")
        metrics["train/is_weight_max"] = stats.max("is_weight_max")
        metrics["train/is_weight_min"] = -stats.max("is_weight_neg_min")
    if "value_loss_den" in s:
        metrics["train/value_loss"] = s["value_loss_num"] / max(s["value_loss_den"], 1.0)
        metrics["train/value_mean"] = stats.mean("value_mean")
        metrics["train/critic_grad_norm"] = s.get("critic_grad_norm", math.nan)
    if "kl_ref:count" in s:
        metrics["train/kl_ref"] = stats.mean("kl_ref")
    return metrics
