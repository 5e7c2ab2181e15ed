"""From sample groups to micro-batch tensors: staleness filter, advantages, packing.

Pure logic over `proto` structs and torch tensors; knows nothing of Redis or megatron. A
micro-batch is either one packed sequence `[1, T]` of whole samples (THD, `cu_seqlens`) whose
length stays under the token budget, or a right-padded `[b, S]` block. Either way token j of a
row predicts token j+1: inputs are `seq[:-1]`, targets `seq[1:]`, and only targets that are
response tokens with `loss_mask` 1 carry loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from proto.packed import AnySample, Group, PackedSample
from services.trainer import losses


class BatchError(ValueError):
    """The samples in hand cannot be trained as configured; the message names the flag."""


class SampleTooLongError(BatchError):
    """One sample does not fit the per-micro-batch token budget."""


@dataclass
class TrainSample:
    """One sample flattened for training, its per-token values as tensors (a micro-batch is
    then cut and joined, not built value by value: ~0.5 µs a token as Python lists).
    `behaviour_logp`, `loss_mask` and `advantages` have one value per response token."""

    tokens: torch.Tensor  # prompt + response, int64
    prompt_len: int
    behaviour_logp: torch.Tensor  # float32
    loss_mask: torch.Tensor  # float32
    advantages: torch.Tensor  # float32
    weight_version: int
    reward: float
    routed_experts: bytes = b""  # `Sample.routed_experts`, for routing replay
    group: int = -1  # index of its group in the rollout

    @property
    def input_len(self) -> int:
        return len(self.tokens) - 1


def all_samples(group: Group) -> Sequence[AnySample]:
    """A group's samples, list-form or packed (one type for the checker)."""
    return group.samples


def split_stale(
    groups: list[tuple[str, Group]], version: int, max_staleness: int
) -> tuple[list[tuple[str, Group]], list[tuple[str, Group]]]:
    """(fresh, stale): stale when `version - group.weight_version > max_staleness`."""
    fresh = [g for g in groups if version - g[1].weight_version <= max_staleness]
    stale = [g for g in groups if version - g[1].weight_version > max_staleness]
    return fresh, stale


def compute_advantages(
    groups: list[Group], estimator: str, normalize_std: bool, eps: float, gamma: float = 1.0
) -> list[list[torch.Tensor]]:
    """Per group, per sample, per response token advantages (outcome reward on the last token),
    float32.

    grpo: (r - mean) / (std + eps) (std optional); dr_grpo: r - mean; reinforce_plus_plus[_baseline]:
    batch-whitened (group-baselined) returns, discounted by `gamma` from the last token;
    gae: zeros here, filled per token by the critic (`critic.py`).
    """
    rewards = [torch.tensor([s.reward for s in g.samples], dtype=torch.float64) for g in groups]
    if estimator == "gae":  # per-token advantages come from the critic, later in the step
        return [[torch.zeros(response_len(s)) for s in all_samples(g)] for g in groups]
    if estimator in ("grpo", "dr_grpo"):
        std = normalize_std and estimator == "grpo"
        per_sample = [losses.grpo_advantages(r, std, eps) for r in rewards]
    elif estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        per_sample = losses.reinforce_pp_advantages(rewards, estimator.endswith("baseline"), eps)
    else:
        raise ValueError(f"advantage_estimator {estimator!r} needs a critic or is unknown")
    out = []
    for g, adv in zip(groups, per_sample, strict=True):
        rows = []
        for s, a in zip(all_samples(g), adv.tolist(), strict=True):
            n = response_len(s)
            if gamma == 1.0 or n == 0:
                rows.append(torch.full((n,), a))
            else:  # (in float64, as the discount of each token always was)
                discount = gamma ** torch.arange(n - 1, -1, -1, dtype=torch.float64)
                rows.append((a * discount).float())
        out.append(rows)
    return out


def flatten(groups: list[Group], advantages: list[list[torch.Tensor]]) -> list[TrainSample]:
    """TrainSamples in group order; samples with no response token are left out."""
    out = []
    for index, (g, group_adv) in enumerate(zip(groups, advantages, strict=True)):
        for s, adv in zip(all_samples(g), group_adv, strict=True):
            if not response_len(s):
                continue
            tokens, logp, mask = _arrays(s)
            out.append(
                TrainSample(
                    tokens=tokens,
                    prompt_len=len(tokens) - response_len(s),
                    behaviour_logp=logp,
                    loss_mask=mask,
                    advantages=adv,
                    weight_version=s.weight_version,
                    reward=s.reward,
                    routed_experts=s.routed_experts,
                    group=index,
                )
            )
    return out


def response_len(s: AnySample) -> int:
    return len(s.response) // 4 if isinstance(s, PackedSample) else len(s.response_ids)


def _arrays(s: AnySample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sample's tokens (prompt + response, int64), behaviour log-probs and loss mask
    (float32; an empty mask is all 1), read from the packed bytes at once where packed."""
    n = response_len(s)
    if isinstance(s, PackedSample):
        tokens = torch.from_numpy(np.frombuffer(s.prompt + s.response, "<i4").astype(np.int64))
        logp = torch.from_numpy(np.frombuffer(s.logprobs, "<f4").astype(np.float32))
        mask = np.frombuffer(s.mask, np.uint8).astype(np.float32)
        return tokens, logp, torch.from_numpy(mask) if s.mask else torch.ones(n)
    tokens = torch.tensor([*s.prompt_ids, *s.response_ids], dtype=torch.long)
    logp = torch.tensor(s.response_logprobs, dtype=torch.float32)
    mask_t = torch.tensor(s.loss_mask, dtype=torch.float32) if s.loss_mask else torch.ones(n)
    return tokens, logp, mask_t


def pack_first_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= budget: first-fit decreasing.

    Raises `SampleTooLongError` for an item longer than the budget.
    """
    too_long = [n for n in lengths if n > budget]
    if too_long:
        raise SampleTooLongError(
            f"a sample of {max(too_long)} tokens exceeds --max-tokens-per-gpu {budget}: raise "
            "--max-tokens-per-gpu (or use context parallelism), or cap the response length"
        )
    bins: list[list[int]] = []
    space: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(space):
            if lengths[i] <= free:
                bins[b].append(i)
                space[b] -= lengths[i]
                break
        else:
            bins.append([i])
            space.append(budget - lengths[i])
    return [sorted(b) for b in bins]


@dataclass
class MicroBatch:
    """Tensors of one micro-batch; every per-token tensor is `[rows, S]`."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logp: torch.Tensor
    advantages: torch.Tensor
    seq_ids: torch.Tensor  # sample index within this micro-batch
    sample_index: list[int]  # index of each sample in the step's sample list
    packed_seq_params: PackedSeqParams | None
    response_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (row, start, stop)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # proximal/ref log-probs
    # routing replay: the engine's experts per input token `[rows, S, moe_layers, top_k]`
    routed_experts: torch.Tensor | None = None
    padding: bool = False  # no samples: only there to match other ranks (`equalize`)

    @property
    def num_seqs(self) -> int:
        return len(self.sample_index)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) input tokens."""
        return int((self.seq_ids >= 0).sum())


def _sample_rows(s: TrainSample, i: int) -> dict[str, torch.Tensor]:
    """Per-position values of one sample over its input positions (length input_len)."""
    n_in, pad = s.input_len, torch.zeros(s.prompt_len - 1)
    return {
        "input_ids": s.tokens[:-1],
        "position_ids": torch.arange(n_in),
        "targets": s.tokens[1:],
        "loss_mask": torch.cat([pad, s.loss_mask]),
        "behaviour_logp": torch.cat([pad, s.behaviour_logp]),
        "advantages": torch.cat([pad, s.advantages]),
        "seq_ids": torch.full((n_in,), i, dtype=torch.long),
    }


def build_micro_batch(samples: list[TrainSample], indices: list[int], packed: bool) -> MicroBatch:
    """Packed `[1, sum(len)]` with cu_seqlens, or right-padded `[len(indices), max(len)]`."""
    rows = [_sample_rows(samples[j], k) for k, j in enumerate(indices)]
    keys = list(rows[0])
    if packed:
        t = {k: torch.cat([r[k] for r in rows])[None] for k in keys}
        lengths = [samples[j].input_len for j in indices]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths),
        )
    else:
        width = max(len(r["input_ids"]) for r in rows)
        pad_value = {"seq_ids": -1}
        t = {
            k: torch.stack(
                [F.pad(r[k], (0, width - len(r[k])), value=pad_value.get(k, 0)) for r in rows]
            )
            for k in keys
        }
        params = None
    spans, offset = [], 0
    for k, j in enumerate(indices):
        s = samples[j]
        row, base = (0, offset) if packed else (k, 0)
        spans.append((row, base + s.prompt_len - 1, base + s.input_len))
        offset += s.input_len
    return MicroBatch(
        sample_index=list(indices), packed_seq_params=params, response_spans=spans, **t
    )


def make_micro_batches(
    samples: list[TrainSample], packed: bool, max_tokens: int, micro_batch_size: int
) -> list[MicroBatch]:
    """Packed under the token budget (first-fit decreasing), or fixed-size padded chunks."""
    if packed:
        bins = pack_first_fit([s.input_len for s in samples], max_tokens)
    else:
        too_long = [s.input_len for s in samples if s.input_len > max_tokens]
        if too_long:
            pack_first_fit(too_long, max_tokens)  # raises the same actionable error
        bins = [
            list(range(i, min(i + micro_batch_size, len(samples))))
            for i in range(0, len(samples), micro_batch_size)
        ]
    return [build_micro_batch(samples, b, packed) for b in bins]


def equalize(mbs: list[MicroBatch], count: int, length: int) -> list[MicroBatch]:
    """Packed micro-batches made `count` in number, each `[1, length]` tokens, for expert
    parallelism: every rank of an expert-parallel group must run the same number of forwards
    and (megatron's allgather dispatcher) the same number of tokens in each. The extra tokens of
    a micro-batch form one more packed segment (so attention sees a well-formed sequence) with
    no loss; an extra micro-batch is all such padding (`padding`, no samples)."""
    out = [_pad_pack(mb, length) for mb in mbs]
    empty = torch.zeros((1, 0), dtype=torch.long)
    while len(out) < count:
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=torch.tensor([0], dtype=torch.int32),
            cu_seqlens_kv=torch.tensor([0], dtype=torch.int32),
            max_seqlen_q=0,
            max_seqlen_kv=0,
        )
        blank = MicroBatch(
            input_ids=empty,
            position_ids=empty,
            targets=empty,
            loss_mask=empty.float(),
            behaviour_logp=empty.float(),
            advantages=empty.float(),
            seq_ids=empty,
            sample_index=[],
            packed_seq_params=params,
            padding=True,
        )
        out.append(_pad_pack(blank, length))
    return out


def _pad_pack(mb: MicroBatch, length: int) -> MicroBatch:
    params = mb.packed_seq_params
    assert params is not None, "equalize needs packed micro-batches"
    extra = length - mb.input_ids.shape[1]
    if extra <= 0:
        return mb
    for name in ("input_ids", "targets", "loss_mask", "behaviour_logp", "advantages"):
        setattr(mb, name, F.pad(getattr(mb, name), (0, extra)))
    mb.seq_ids = F.pad(mb.seq_ids, (0, extra), value=-1)
    mb.position_ids = torch.cat([mb.position_ids, torch.arange(extra)[None]], dim=1)
    cu = torch.cat([params.cu_seqlens_q, torch.tensor([length], dtype=torch.int32)])
    top = max(int(params.max_seqlen_q), extra)
    mb.packed_seq_params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=top, max_seqlen_kv=top
    )
    return mb
