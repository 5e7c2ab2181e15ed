"""Which Hugging Face architectures Tandem trains and serves, checked from `config.json` alone.

Every service (trainer, reference engine, rollout router) calls `check_model_dir` at start-up so
that an unsupported checkpoint is refused with the same one line everywhere, before any weights
are read. Knows only the `config.json` fields that decide support; no torch, no transformers.
"""

from __future__ import annotations

import array
import base64
import json
import sys
from pathlib import Path
from typing import Any

# Pre-norm decoders with rotary embeddings, SwiGLU MLPs (or Qwen3-MoE's top-k SwiGLU experts),
# optional qkv bias (qwen2) and per-head q/k RMSNorm (qwen3, qwen3_moe).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen3_moe",)


def read_config(model_dir: str | Path, flag: str = "--model") -> tuple[dict[str, Any], str]:
    """(parsed `config.json`, its path) of a HF model directory given as `flag`;
    FileNotFoundError names it, ValueError names the file when it is not a JSON object."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {flag} must be a Hugging Face model directory")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:  # (a download cut short, a hand edit)
        raise ValueError(
            f"{path} is not JSON ({exc}): {flag} needs a model's config.json"
        ) from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a {type(cfg).__name__}, not a config.json's object")
    return cfg, str(path)


def check_model_config(cfg: dict[str, Any], path: str = "config.json") -> str:
    """The `model_type` of a parsed `config.json`, or ValueError (one line naming `path`)."""
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not supported; supported model_types: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    if model_type in MOE_MODEL_TYPES:
        sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense_layers = cfg.get("mlp_only_layers") or []
        if sparse_step != 1 or dense_layers:
            raise ValueError(
                f"{path}: decoder_sparse_step {sparse_step} / mlp_only_layers {dense_layers} "
                "mix dense and MoE layers; only all-MoE models (decoder_sparse_step 1, "
                "mlp_only_layers []) are supported"
            )
        if int(cfg.get("shared_expert_intermediate_size", 0) or 0):
            raise ValueError(f"{path}: shared experts are not supported")
    return model_type


def check_model_dir(model_dir: str | Path) -> str:
    """`check_model_config` of a HF model directory's `config.json`."""
    cfg, path = read_config(model_dir)
    return check_model_config(cfg, path)


def check_sliding_window(cfg: dict[str, Any], path: str, context_tokens: int, flag: str) -> None:
    """Refuse a `sliding_window` shorter than the `context_tokens` a service may run (set by
    `flag`): Tandem's attention is full causal attention, which equals sliding-window
    attention only within the window."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window and int(window) < context_tokens:
        raise ValueError(
            f"{path}: sliding_window {window} is shorter than the context in use "
            f"({context_tokens} tokens) and sliding-window attention is not implemented; "
            f"set {flag} <= {window}"
        )


def pack_routed_experts(b64: str) -> bytes:
    """SGLang's `meta_info.routed_experts` (base64 of int32 expert indices) in the compact form
    `Sample.routed_experts` carries: uint8 when every index is < 256, else int16 (little-endian).
    The reader tells the two apart by the size (it knows positions x layers x top_k)."""
    values = array.array("i", base64.b64decode(b64))
    if sys.byteorder == "big":
        values.byteswap()
    if max(values, default=0) < 256:
        return array.array("B", values).tobytes()
    packed = array.array("h", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()
