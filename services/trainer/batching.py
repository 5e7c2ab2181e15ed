"""From sample groups to micro-batch tensors: staleness filter, advantages, packing.

Pure logic over `proto` structs and torch tensors; knows nothing of Redis or megatron. A
micro-batch is either one packed sequence `[1, T]` of whole samples (THD, `cu_seqlens`) whose
length stays under the token budget, or a right-padded `[b, S]` block. Either way token j of a
row predicts token j+1: inputs are `seq[:-1]`, targets `seq[1:]`, and only targets that are
response tokens with `loss_mask` 1 carry loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

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
    """One sample flattened for training, its per-token values as numpy arrays: a micro-batch
    is joined from them at once (`build_micro_batch`), not built value by value (~0.5 µs a
    token as Python lists). `behaviour_logp`, `loss_mask` and `advantages` have one value per
    response token."""

    tokens: np.ndarray  # prompt + response (int32 or int64)
    prompt_len: int
    behaviour_logp: np.ndarray
    loss_mask: np.ndarray  # 0 or 1 (uint8 or float32)
    advantages: np.ndarray
    weight_version: int
    reward: float
    routed_experts: bytes = b""  # `Sample.routed_experts`, for routing replay
    group: int = -1  # index of its group in the rollout
    temperature: float = 1.0  # `Sample.temperature`: the trainer scores it at the same

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
) -> list[list[np.ndarray]]:
    """Per group, per sample, per response token advantages (outcome reward on the last token),
    float32.

    grpo: (r - mean) / (std + eps) (std optional); dr_grpo: r - mean; reinforce_plus_plus[_baseline]:
    batch-whitened (group-baselined) returns, discounted by `gamma` from the last token;
    gae: zeros here, filled per token by the critic (`critic.py`).
    """
    rewards = [torch.tensor([s.reward for s in g.samples], dtype=torch.float64) for g in groups]
    if estimator == "gae":  # per-token advantages come from the critic, later in the step
        return [[np.zeros(response_len(s), np.float32) for s in all_samples(g)] for g in groups]
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
                rows.append(np.full(n, a, np.float32))
            else:  # (in float64, as the discount of each token always was)
                discount = gamma ** np.arange(n - 1, -1, -1, dtype=np.float64)
                rows.append((a * discount).astype(np.float32))
        out.append(rows)
    return out


def flatten(groups: list[Group], advantages: list[list[np.ndarray]]) -> list[TrainSample]:
    """TrainSamples in group order; samples with no response token are left out."""
    out = []
    for index, (g, group_adv) in enumerate(zip(groups, advantages, strict=True)):
        for s, adv in zip(all_samples(g), group_adv, strict=True):
            if not (n := response_len(s)):
                continue
            tokens, logp, mask = _arrays(s)
            out.append(
                TrainSample(
                    tokens=tokens,
                    prompt_len=len(tokens) - n,
                    behaviour_logp=logp,
                    loss_mask=mask,
                    advantages=adv,
                    weight_version=s.weight_version,
                    reward=s.reward,
                    routed_experts=s.routed_experts,
                    group=index,
                    temperature=s.temperature,
                )
            )
    return out


def response_len(s: AnySample) -> int:
    return len(s.response) // 4 if isinstance(s, PackedSample) else len(s.response_ids)


def _arrays(s: AnySample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sample's tokens (prompt + response), behaviour log-probs and loss mask (an empty mask
    is all 1); a packed sample's stored arrays as read-only views of its bytes, copied once,
    into the micro-batch's types, by `build_micro_batch`."""
    if not isinstance(s, PackedSample):
        tokens = np.array([*s.prompt_ids, *s.response_ids], np.int64)
        mask = np.array(s.loss_mask or [1] * len(s.response_ids), np.float32)
        return tokens, np.array(s.response_logprobs, np.float32), mask
    tokens = np.frombuffer(s.prompt + s.response, "<i4")
    logp = np.frombuffer(s.logprobs, "<f4")
    if not s.mask:
        return tokens, logp, np.ones(len(s.response) // 4, np.float32)
    return tokens, logp, np.frombuffer(s.mask, np.uint8)


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
    # recomputed before the update, `[rows, S]` on the host (None: not recomputed this step):
    proximal_logp: torch.Tensor | None = None  # the policy's log-probs before the update
    entropy: torch.Tensor | None = None  # its entropy per token, with them
    ref_logp: torch.Tensor | None = None  # the reference model's (--ref-load)
    returns: torch.Tensor | None = None  # gae: the critic's value targets
    old_values: torch.Tensor | None = None  # gae: the critic's values before the update
    # routing replay: the engine's experts per input token `[rows, S, moe_layers, top_k]`
    routed_experts: torch.Tensor | None = None
    # the temperature each input token's logits are divided by (its sample's, 1 at padding),
    # `[rows, S]` float32; None = 1 everywhere (no division)
    temperature: torch.Tensor | None = None
    padding: bool = False  # no samples: only there to match other ranks (`equalize`)

    @property
    def num_seqs(self) -> int:
        return len(self.sample_index)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) input tokens."""
        return int((self.seq_ids >= 0).sum())

    def to(self, device: str) -> MicroBatch:
        """A copy whose tensors are on `device`, copied without waiting for it: a copy from
        the host that waits (`.to(device)`) lets the GPU's queue run dry in mid-step."""
        moved = {
            name: value.to(device, non_blocking=True)
            for name, value in vars(self).items()
            if isinstance(value, torch.Tensor)
        }
        params = self.packed_seq_params
        if params is not None:
            cu = params.cu_seqlens_q.to(device, non_blocking=True)
            params = PackedSeqParams(
                qkv_format=params.qkv_format,
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=params.max_seqlen_q,
                max_seqlen_kv=params.max_seqlen_kv,
            )
        return replace(self, packed_seq_params=params, **moved)


_INTS = ("input_ids", "position_ids", "targets", "seq_ids")
_FLOATS = ("loss_mask", "behaviour_logp", "advantages")


def build_micro_batch(samples: list[TrainSample], indices: list[int], packed: bool) -> MicroBatch:
    """Packed `[1, sum(len)]` with cu_seqlens, or right-padded `[len(indices), max(len)]`
    (padding: `seq_ids` -1, every other value 0). Each sample's arrays are copied in whole
    (its inputs, targets, and its response values after its prompt), not value by value."""
    chosen = [samples[j] for j in indices]
    lengths = [s.input_len for s in chosen]
    shape = (1, sum(lengths)) if packed else (len(chosen), max(lengths))
    out = {name: np.zeros(shape, np.int64) for name in _INTS}
    out["seq_ids"].fill(-1)
    out.update({name: np.zeros(shape, np.float32) for name in _FLOATS})
    positions = np.arange(max(lengths))
    spans, offset = [], 0
    for k, s in enumerate(chosen):
        row, base = (0, offset) if packed else (k, 0)
        first, end = base + s.prompt_len - 1, base + s.input_len  # its response's targets
        out["input_ids"][row, base:end] = s.tokens[:-1]
        out["targets"][row, base:end] = s.tokens[1:]
        out["position_ids"][row, base:end] = positions[: s.input_len]
        out["seq_ids"][row, base:end] = k
        for name in _FLOATS:
            out[name][row, first:end] = getattr(s, name)
        spans.append((row, first, end))
        offset += s.input_len
    params = None
    if packed:
        cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
        top = max(lengths)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=top, max_seqlen_kv=top
        )
    return MicroBatch(
        sample_index=list(indices),
        packed_seq_params=params,
        response_spans=spans,
        temperature=_temperature(chosen, out["seq_ids"]),
        **{name: torch.from_numpy(value) for name, value in out.items()},
    )


def _temperature(chosen: list[TrainSample], seq_ids: np.ndarray) -> torch.Tensor | None:
    """Each token's sample's temperature (1 at padding); None when every one is 1."""
    if all(s.temperature == 1.0 for s in chosen):
        return None
    per_sample = np.array([*(s.temperature for s in chosen), 1.0], np.float32)
    return torch.from_numpy(per_sample[seq_ids])  # (seq_ids -1, padding, picks the last: 1)


def make_micro_batches(
    samples: list[TrainSample], packed: bool, max_tokens: int, micro_batch_size: int
) -> list[MicroBatch]:
    """Packed under the token budget (first-fit decreasing), or fixed-size padded chunks."""
    if packed:
        bins = pack_first_fit([s.input_len for s in samples], max_tokens)
    else:
        too_long = [s.input_len for s in samples if s.input_len > max_tokens]
        pack_first_fit(too_long, max_tokens)  # (raises the same actionable error for any)
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
    if mb.temperature is not None:
        mb.temperature = F.pad(mb.temperature, (0, extra), value=1.0)
    mb.position_ids = torch.cat([mb.position_ids, torch.arange(extra)[None]], dim=1)
    cu = torch.cat([params.cu_seqlens_q, torch.tensor([length], dtype=torch.int32)])
    top = max(int(params.max_seqlen_q), extra)
    mb.packed_seq_params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=top, max_seqlen_kv=top
    )
    return mb
