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

RoPE of packed sequences (`packed_rope`): megatron's unfused THD path splits the pack per
sample on the host (a device sync per call) and runs five elementwise kernels per call. Here
each token's position within its sample is computed on the device once per micro-batch (cached
across layers), and the rotation is one fused kernel on CUDA (torch.compile; eager elsewhere, and
`TANDEM_COMPILE=0` turns compilation off). `gpt_layer_spec()` installs it in megatron's attention.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from services.trainer.cpu_compat import fused

log = logging.getLogger(__name__)


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


@functools.cache
def _varlen_params() -> frozenset[str]:
    """varlen_attn's parameters (imported at the first CUDA call: its module imports torch's
    compiler, ~0.8 s of a CPU trainer's start)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


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
        if "enable_gqa" in _varlen_params():
            extra["enable_gqa"] = True
        elif groups > 1:  # torch 2.11's varlen_attn has no enable_gqa: expand k/v heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # Causal: torch 2.11 takes is_causal; later releases express it as a (-1, 0) window.
        if "is_causal" in _varlen_params():
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


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on [t, h, d] with the half-width cos/sin of each token ([t, 1, d/2]):
    the same as megatron's `t * cos + rotate_half(t) * sin` with cos = cat(c, c)."""
    half = t.shape[-1] // 2
    t1, t2 = t[..., :half], t[..., half:]
    return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)


_rotate_fused = fused(_rotate)
_positions_cache: dict[str, Any] = {}


def _token_cos_sin(
    cu_seqlens: torch.Tensor, freqs: torch.Tensor, tokens: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ([tokens, 1, d/2], `dtype`) at each token's position within its sample.

    Every layer of one forward passes the same `cu_seqlens` and `freqs` objects: the result is
    kept while both live (weak references, so a new micro-batch never sees stale positions)."""
    c = _positions_cache
    if (
        c.get("cu") is not None
        and c["cu"]() is cu_seqlens
        and c["freqs"]() is freqs
        and c["key"] == (tokens, dtype)
    ):
        return c["cos"], c["sin"]
    idx = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sample = torch.searchsorted(cu_seqlens[1:], idx, right=True).clamp(max=cu_seqlens.numel() - 1)
    pos = (idx - cu_seqlens[sample]).clamp(0, freqs.shape[0] - 1).long()
    half = freqs.shape[-1] // 2
    angles = freqs.reshape(freqs.shape[0], -1)[pos, :half].unsqueeze(1)  # [t, 1, d/2]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    c.update(
        cu=weakref.ref(cu_seqlens), freqs=weakref.ref(freqs), key=(tokens, dtype), cos=cos, sin=sin
    )
    return cos, sin


_megatron_apply_rope = rope_utils.apply_rotary_pos_emb


def packed_rope(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config: TransformerConfig,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> torch.Tensor:
    """megatron's `apply_rotary_pos_emb`, with THD-packed input handled as described above;
    every other case (padded batches, interleaved or partial rotary, mscale, context
    parallelism) goes to megatron's own function."""
    plain = (
        cu_seqlens is not None
        and not config.rotary_interleaved
        and not config.multi_latent_attention
        and mscale == 1.0
        and t.dim() == 3
        and freqs.shape[-1] == t.shape[-1]
        and (cp_group is None or cp_group.size() == 1)
    )
    if not plain:
        return _megatron_apply_rope(t, freqs, config, cu_seqlens, mscale=mscale, cp_group=cp_group)
    assert cu_seqlens is not None
    cos, sin = _token_cos_sin(cu_seqlens, freqs, t.shape[0], t.dtype)
    return _rotate_fused(t, cos, sin)


def gpt_layer_spec(qk_layernorm: bool = False, num_experts: int = 0) -> ModuleSpec:
    """megatron's local GPT layer spec (RMSNorm; per-head q/k RMSNorm with `qk_layernorm`; an
    MoE MLP of `num_experts` SequentialMLP experts if > 0) with this module as core attention,
    and `packed_rope` in place of megatron's RoPE function (its attention module looks it up by
    name at call time)."""
    from megatron.core.transformer import attention
    from megatron.core.transformer.moe import moe_utils

    attention.apply_rotary_pos_emb = packed_rope
    # megatron-core 0.16.1 tests `te_general_gemm is not None` in the router's gating without
    # defining the name when TransformerEngine is absent: define it as absent.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=qk_layernorm,
        normalization="RMSNorm",
    )
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec
