"""Core attention for the local (no TransformerEngine) GPT layer spec, padded or packed.

megatron-core's local `DotProductAttention` refuses `PackedSeqParams`. This module takes its
place in the layer spec (`gpt_layer_spec()`), with the same constructor and call signature:

- `sbhd` (no `packed_seq_params`): right-padded micro-batch `[s, b, heads, dim]`, causal SDPA.
  Right padding needs no extra mask under a causal mask: real tokens never see later pads.
- `thd` (`packed_seq_params.qkv_format == "thd"`): one packed sequence `[t, heads, dim]` whose
  samples are delimited by `cu_seqlens_q`. On CUDA: `torch.nn.attention.varlen.varlen_attn`.
  On CPU: (and CUDA in fp32) samples of equal length are stacked and run through one causal SDPA call each, so a
  pack costs one call per distinct length, and nothing is O(t^2) in the pack length.

Attention is causal and self-attention only; no sliding window, no context parallelism.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


class PackedDotProductAttention(MegatronModule):
    """Causal attention over right-padded batches or THD-packed sequences (GQA aware)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("PackedDotProductAttention does not do context parallelism")
        self.softmax_scale = softmax_scale
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            out = _packed_attention(
                query, key, value, packed_seq_params, self.softmax_scale, dropout_p
            )
            return out.reshape(out.size(0), -1)
        if attention_mask is not None:
            raise ValueError(
                "right-padded batches rely on the causal mask; pass attention_mask=None"
            )
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, scale=self.softmax_scale, enable_gqa=True
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _varlen_params() -> frozenset[str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


_VARLEN_PARAMS = _varlen_params()


def _packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """[t, h, d] in, [t, h, d] out; each segment of `cu_seqlens_q` attends causally to itself."""
    cu = params.cu_seqlens_q
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):  # flash kernels: half only
        from torch.nn.attention.varlen import varlen_attn

        if dropout_p:
            raise ValueError("varlen_attn has no dropout; set attention dropout to 0")
        max_len = int(params.max_seqlen_q)
        extra: dict[str, Any] = {}
        groups = q.shape[1] // k.shape[1]
        if "enable_gqa" in _VARLEN_PARAMS:
            extra["enable_gqa"] = True
        elif groups > 1:  # torch 2.11's varlen_attn has no enable_gqa: expand k/v heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # Causal: torch 2.11 takes is_causal; later releases express it as a (-1, 0) window.
        if "is_causal" in _VARLEN_PARAMS:
            extra["is_causal"] = True
        else:
            extra["window_size"] = (-1, 0)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **extra)
    lengths = (cu[1:] - cu[:-1]).tolist()
    starts = cu[:-1].tolist()
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, lengths, strict=True):
        if length > 0:
            by_length.setdefault(length, []).append(start)
    pieces, order = [], []
    for length, seg_starts in by_length.items():
        idx = torch.tensor(seg_starts, device=q.device).unsqueeze(1) + torch.arange(
            length, device=q.device
        )
        qs, ks, vs = (x[idx].transpose(1, 2) for x in (q, k, v))  # [n, h, L, d]
        out = F.scaled_dot_product_attention(
            qs, ks, vs, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=True
        )
        pieces.append(out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2]))
        order.append(idx.reshape(-1))
    flat = torch.cat(pieces)
    positions = torch.cat(order)
    # Tokens past cu[-1] (padding of the pack, if any) get zeros; they carry no loss.
    result = q.new_zeros(q.shape)
    return result.index_copy(0, positions, flat)


def gpt_layer_spec() -> ModuleSpec:
    """megatron's local GPT layer spec (RMSNorm) with this module as core attention."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec
