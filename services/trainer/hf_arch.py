"""Hugging Face `config.json` -> the architecture facts and the megatron-core model built from them.

Knows: the HF config fields of the supported families (`proto.models.SUPPORTED_MODEL_TYPES`):
Llama and Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm, a `head_dim` of its own) and
Qwen3-MoE (top-k softmax router over SwiGLU experts, no shared expert; the experts
megatron's `SequentialMLP` or `grouped_experts`); tied or untied
embeddings; llama3 RoPE scaling; how each maps onto a megatron `TransformerConfig` and the
local layer spec. Mistral's sliding window is only recorded here: whether it is ever reached
depends on the context a service uses, which the service checks at start-up
(`proto.models.check_sliding_window`).

Does not know weights (`hf_convert`), training or the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from proto.models import MOE_MODEL_TYPES, check_model_config, read_config
from services.trainer.cpu_compat import fused_kernels_enabled
from services.trainer.grouped_experts import experts_spec
from services.trainer.packed_attention import gpt_layer_spec


@dataclass(frozen=True)
class HfArch:
    """The architecture facts of a HF checkpoint the converter and trainer need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling_factor: float = 0.0  # > 0: llama3-style RoPE scaling with this factor
    qk_norm: bool = False  # RMSNorm over each q and k head (Qwen3)
    sliding_window: int = 0  # Mistral: attention span in tokens (0 = full attention)
    num_experts: int = 0  # > 0: every layer's MLP is a top-k MoE (Qwen3-MoE)
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True  # top-k weights renormalized to sum to 1

    def padded_vocab_size(self, divisible_by: int, tp_size: int) -> int:
        """Vocab rounded up so each TP rank holds an equal slice of `divisible_by` multiples."""
        multiple = divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple


def read_hf_arch(model_dir: str | Path, flag: str = "--model") -> HfArch:
    """Parse `config.json` of a HF model directory (given as `flag`); errors name the file and
    the field."""
    cfg, path = read_config(model_dir, flag)
    return arch_from_config(cfg, path)


def arch_from_config(cfg: dict, path: str = "config.json") -> HfArch:
    """`HfArch` from a parsed HF `config.json`; `path` only names the source in errors (one
    line naming the field that is missing or not what it must be)."""
    model_type = check_model_config(cfg, path)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    scaling = 0.0
    if rope_type == "llama3" and _is_megatron_llama3(rope):
        scaling = float(rope["factor"])
    elif rope_type != "default":
        raise ValueError(
            f"{path}: rope scaling {rope!r} is not supported (default RoPE, or llama3 with "
            "low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)"
        )
    _check_sizes(cfg, path, model_type)
    heads = cfg["num_attention_heads"]
    moe = model_type in MOE_MODEL_TYPES
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return HfArch(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        rope_scaling_factor=scaling,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=int(window or 0),
        num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]) if moe else 0,
        moe_topk=int(cfg["num_experts_per_tok"]) if moe else 0,
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]) if moe else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if moe else True,
    )


REQUIRED_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")
MOE_SIZES = ("num_experts_per_tok", "moe_intermediate_size")


def _check_sizes(cfg: dict, path: str, model_type: str) -> None:
    """ValueError naming the first size field of `cfg` that is missing (a required one) or
    not a positive integer, or heads that do not divide."""
    required = REQUIRED_SIZES + (MOE_SIZES if model_type in MOE_MODEL_TYPES else ())
    for field in required + OPTIONAL_SIZES:
        value = cfg.get(field)
        if value is None and field in OPTIONAL_SIZES:
            continue
        if value is None:
            raise ValueError(f"{path}: no {field} (a {model_type} config.json states it)")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{path}: {field} is {value!r}, not a positive integer")
    if model_type in MOE_MODEL_TYPES and not (
        cfg.get("num_experts") or cfg.get("num_local_experts")
    ):
        raise ValueError(f"{path}: no num_experts (a {model_type} config.json states it)")
    heads, groups = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    if heads % groups:
        raise ValueError(
            f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}"
        )
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        raise ValueError(
            f"{path}: hidden_size {cfg['hidden_size']} is not a multiple of num_attention_heads {heads} (and no head_dim)"
        )


def _is_megatron_llama3(rope: dict) -> bool:
    """megatron-core hard-codes these llama3 scaling constants (Llama 3.1 / 3.2 use them)."""
    return (
        float(rope.get("low_freq_factor", 0)) == 1.0
        and float(rope.get("high_freq_factor", 0)) == 4.0
        and int(rope.get("original_max_position_embeddings", 0)) == 8192
    )


def _moe_fields(
    arch: HfArch, ep_size: int, aux_loss_coeff: float, routing_replay: bool, grouped: bool
) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3-MoE layer (none for a dense model).

    megatron's default router takes the top-k of the logits and softmaxes over those k, which
    equals HF's softmax-then-top-k renormalized (`norm_topk_prob`); without renormalization
    HF's weights are the full softmax's top-k, megatron's `moe_router_pre_softmax`.
    `moe_grouped_gemm` chooses the experts' module in `build_gpt_model`."""
    if not arch.num_experts:
        return {}
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_grouped_gemm=grouped,
        # alltoall builds a CUDA stream at construction: allgather is the one that runs on CPU
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        expert_model_parallel_size=ep_size,
        moe_enable_routing_replay=routing_replay,
    )


def transformer_config(
    arch: HfArch,
    tp_size: int = 1,
    bf16: bool = False,
    ep_size: int = 1,
    moe_aux_loss_coeff: float = 0.0,
    routing_replay: bool = False,
    grouped_experts: bool = False,
) -> TransformerConfig:
    """megatron TransformerConfig equal to the HF architecture (no dropout, unfused kernels);
    an MoE's experts are grouped GEMMs with `grouped_experts`, else megatron's SequentialMLP."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=fused_kernels_enabled(),  # SwiGLU as one compiled kernel
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp_size,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        bf16=bf16,
        pipeline_dtype=dtype,
        **_moe_fields(arch, ep_size, moe_aux_loss_coeff, routing_replay, grouped_experts),
    )


def build_gpt_model(
    arch: HfArch, config: TransformerConfig, vocab_divisible_by: int, padded_vocab: int = 0
) -> GPTModel:
    """An un-initialised (random) GPTModel shaped like `arch`, with the packed-attention spec.
    `padded_vocab` (if set) overrides the padding rule, e.g. to match a checkpoint. An MoE's
    experts are `GroupedExperts` with `config.moe_grouped_gemm`, else megatron's `SequentialMLP`
    (the two write the same checkpoints)."""
    spec = gpt_layer_spec(arch.qk_norm, arch.num_experts)
    if arch.num_experts and config.moe_grouped_gemm:
        spec = experts_spec(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab
        or arch.padded_vocab_size(vocab_divisible_by, config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rope_scaling=arch.rope_scaling_factor > 0,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
    # megatron's torch-norm wrapper builds its norms in the default dtype (fp32): a bf16 input
    # then misses torch's fused RMSNorm kernel. Hold them in params_dtype, as HF bf16 does.
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.to(config.params_dtype)
    return model
