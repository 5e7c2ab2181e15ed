"""Tiny random-init Hugging Face checkpoints of every supported `model_type`, made locally.

Vocabulary = the toy tokenizer's 16 characters (its files are written beside the weights), so
the engine, the router and `tandem up` can serve them. Norm weights (incl. Qwen3's q/k norms)
and MoE routers are randomized too: a wrong mapping of any of them shows in the logits; MoE
experts get larger weights than transformers' init, so that which expert a token goes to
changes the output visibly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = dict(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MOE: dict[str, Any] = dict(
    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24
)
# name -> (config class, model class, config fields beyond COMMON)
TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    # head_dim 16: heads * head_dim = 64 differs from hidden 32
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3_untied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=8, tie_word_embeddings=False, rope_theta=1e6),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(**MOE, norm_topk_prob=True, tie_word_embeddings=False),
    ),
    "qwen3_moe_unnormed": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(**MOE, norm_topk_prob=False, tie_word_embeddings=True),
    ),
}


def write_tiny(
    out: Path, name: str, seed: int = 0, router_std: float = 1.0, **overrides: Any
) -> Path:
    """Write tiny model `name` (a key of `TINY`) with the toy tokenizer to `out`; an MoE
    router's weights get std `router_std` (small: many near-ties between experts)."""
    import transformers

    from tandem.toy_model import build_tokenizer

    config_name, model_name, extra = TINY[name]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(1.0, 0.2)
            elif param_name.endswith("mlp.gate.weight"):  # router: diverse expert choices
                param.normal_(0.0, router_std)
            elif ".experts." in param_name:  # experts that differ enough for routing to matter
                param.normal_(0.0, 0.3)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out
