"""PPO with a critic: per-token values, GAE advantages, and the clipped value loss.

The critic is a second megatron model initialised from the policy's HF weights with a zeroed
value head (`Policy(value_head=True)`), trained by its own optimizer in the same step. Per step:
  values   forward-only critic pass: V(s_t) for every response position (the state before
           response token t is emitted);
  gae      token rewards are 0 except the sample's reward on its last response token; GAE with
           `gamma`/`lambd` gives advantages and returns; advantages are whitened over the
           step's response tokens (all data-parallel ranks);
  policy   the usual clipped policy loss with these per-token advantages (trainer);
  critic   0.5 * max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2), token mean.
Tensor parallelism 1 only (validated in `TrainerConfig.validate`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from services.trainer import losses
from services.trainer.batching import MicroBatch, TrainSample
from services.trainer.config import TrainerConfig
from services.trainer.policy import Policy
from services.trainer.stats import StepStats, comm_device


class Critic:
    """The value model and what the step does with it."""

    def __init__(self, cfg: TrainerConfig, model_dir: str) -> None:
        self.cfg = cfg
        rate = {"lr": cfg.optimizer.critic_lr or cfg.optimizer.lr}
        own = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update=rate)})
        self.model = Policy(own, model_dir, value_head=True)

    def fill_advantages(
        self, mbs: list[MicroBatch], samples: list[TrainSample], stats: StepStats
    ) -> None:
        """Values -> GAE -> whitened `mb.advantages`; keeps returns and old values for the loss."""
        outs = self.model.logprobs(mbs)
        for mb, out in zip(mbs, outs, strict=True):
            values = out["logp"].float().cpu()
            # Gather each sample's response span into a right-padded [samples, T] block.
            width = max(stop - start for _, start, stop in mb.response_spans)
            rows = torch.tensor([row for row, _, _ in mb.response_spans]).unsqueeze(1)
            cols = torch.tensor([start for _, start, _ in mb.response_spans]).unsqueeze(1)
            lengths = torch.tensor([stop - start for _, start, stop in mb.response_spans])
            offsets = torch.arange(width)
            valid = offsets < lengths.unsqueeze(1)
            cols = torch.where(valid, cols + offsets, 0)
            span_values = torch.where(valid, values[rows, cols], 0.0)
            rewards = torch.zeros_like(span_values)
            last = (lengths - 1).unsqueeze(1)
            rewards.scatter_(1, last, torch.tensor([[samples[i].reward] for i in mb.sample_index]))
            adv_block, ret_block = losses.gae(
                rewards, span_values, self.cfg.loss.gamma, self.cfg.loss.lambd
            )
            adv, returns = torch.zeros_like(values), torch.zeros_like(values)
            adv[rows.expand_as(cols)[valid], cols[valid]] = adv_block[valid]
            returns[rows.expand_as(cols)[valid], cols[valid]] = ret_block[valid]
            mb.advantages = adv
            mb.returns, mb.old_values = returns, values
            stats.add("value_mean", (values * mb.loss_mask).sum(), mb.loss_mask.sum())
        _whiten(mbs, self.cfg.loss.advantage_eps)

    def train(self, mbs: list[MicroBatch], stats: StepStats) -> None:
        _, _, grad_norm = self.model.train_step(
            mbs, ValueLoss(self.cfg.loss.value_clip, stats), with_entropy=False
        )
        stats.count("critic_grad_norm", grad_norm)


def _whiten(mbs: list[MicroBatch], eps: float) -> None:
    """Advantages to zero mean, unit variance over the response tokens of all DP ranks."""
    sums = torch.zeros(3, dtype=torch.float64)
    for mb in mbs:
        a, m = mb.advantages.double(), mb.loss_mask.double()
        sums += torch.stack([(a * m).sum(), (a * a * m).sum(), m.sum()])
    if dist.is_initialized() and parallel_state.get_data_parallel_world_size() > 1:
        sums = sums.to(comm_device())
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        sums = sums.cpu()
    count = max(float(sums[2]), 1.0)
    mean = float(sums[0]) / count
    std = max(float(sums[1]) / count - mean * mean, 0.0) ** 0.5
    for mb in mbs:
        mb.advantages = (mb.advantages - mean) / (std + eps) * mb.loss_mask


class ValueLoss:
    """Clipped value loss, token mean (numerator, integer denominator) for megatron."""

    def __init__(self, value_clip: float, stats: StepStats) -> None:
        self.value_clip, self.stats = value_clip, stats

    def __call__(self, mb: MicroBatch, values: torch.Tensor, _entropy: torch.Tensor | None):  # type: ignore[no-untyped-def]
        dev = values.device
        mask = mb.loss_mask.to(dev)
        assert mb.returns is not None and mb.old_values is not None, "set by `advantages`"
        returns, old = mb.returns.to(dev), mb.old_values.to(dev)
        loss = (values - returns).square()
        if self.value_clip > 0:
            clipped = old + (values - old).clamp(-self.value_clip, self.value_clip)
            loss = torch.maximum(loss, (clipped - returns).square())
        num = 0.5 * (loss * mask).sum()
        self.stats.count("value_loss_num", num.detach())
        self.stats.count("value_loss_den", mask.sum())
        return num, mask.sum().round().to(torch.int), {}
