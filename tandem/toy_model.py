"""The built-in tiny model: a random-init Llama with a 16-token character vocabulary.

Written as a Hugging Face directory (`config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`), created locally from a fixed seed; nothing is downloaded.
"""

from __future__ import annotations

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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, logging

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    logging.disable_progress_bar()  # (a bar for a 400 KB file, on `tandem up`'s console)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
