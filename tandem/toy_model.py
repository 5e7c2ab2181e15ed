"""The built-in tiny model: a random-init Llama with a 16-token character vocabulary.

Written as a Hugging Face directory (`config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`), created locally from a fixed seed; nothing is downloaded. Making one
imports torch and transformers (~5 s of a `tandem up` of the toy task that trains in seconds), so
the one made is kept in a cache folder (`cache_root`) under a key of this file, its arguments and
the library versions, and a later write copies it: the same bytes either way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

# Order fixes the token ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, digits 4-13, '>'=14, '='=15.
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
VOCAB = SPECIAL_TOKENS + [str(d) for d in range(10)] + [">", "="]


def build_tokenizer():  # type: ignore[no-untyped-def]
    """A character-level fast tokenizer: each character is a token; BOS is prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def write_toy_model(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 192,
) -> Path:
    """Write the tiny model to `out_dir` and return the path. Same seed, same bytes."""
    shape = dict(seed=seed, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads)
    shape.update(num_kv_heads=num_kv_heads, intermediate_size=intermediate_size)
    out = Path(out_dir)
    cached = cache_root() / cache_key(shape)
    if not cached.is_dir():
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            made = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".making-"))
        except OSError:  # no cache to keep it in: made where it goes, each time
            return _make(out, shape)
        _make(made, shape)
        try:
            made.rename(cached)  # (whole or not at all; another process may have made it first)
        except OSError:
            shutil.rmtree(made, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for file in cached.iterdir():
        shutil.copyfile(file, out / file.name)
    return out


def cache_root() -> Path:
    """Where made toy models are kept: $TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else
    ~/.cache/tandem (one folder per key, a few hundred KB each)."""
    if root := os.environ.get("TANDEM_CACHE_DIR"):
        return Path(root) / "toy-models"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "tandem" / "toy-models"


def cache_key(shape: dict[str, int]) -> str:
    """What the bytes depend on: this file, the arguments, torch's and transformers' versions."""
    versions = {name: metadata.version(name) for name in ("torch", "transformers", "tokenizers")}
    text = Path(__file__).read_bytes() + json.dumps([shape, versions], sort_keys=True).encode()
    return f"seed{shape['seed']}-{hashlib.sha256(text).hexdigest()[:16]}"


def _make(out: Path, shape: dict[str, int]) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, logging

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(shape["seed"])
    model = LlamaForCausalLM(config)
    logging.disable_progress_bar()  # (a bar for a 400 KB file, on `tandem up`'s console)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
