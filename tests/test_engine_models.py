"""The engine's forward matches `transformers` for every model type it claims to serve.

Tiny random-init checkpoints of each architecture (Qwen2's q/k/v biases, Qwen3's q/k norms,
Llama 3 rope scaling, tied embeddings, Qwen3-MoE's experts) go through the engine's own prefill + decode with a
ragged batch; every step's logits must equal a full `transformers` forward of the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.model_runner import KVCache, ModelRunner
from tandem.toy_model import build_tokenizer

COMMON = dict(
    vocab_size=16,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
ARCHITECTURES = {
    "llama_tied_rope_scaled": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2_with_biases": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3_with_qk_norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
    ),
}


def write(out: Path, arch: str) -> Path:
    import transformers

    config_name, model_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    getattr(transformers, model_name)(config).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_prefill_and_decode_logits_equal_a_full_transformers_forward(
    tmp_path: Path, arch: str, device: str
) -> None:
    runner = ModelRunner(str(write(tmp_path / arch, arch)), "", device, "float32")
    prompts = [[1, 4, 5, 6, 14], [1, 9], [1, 7, 7, 8, 9, 10, 11, 14]]
    seqs = [list(p) for p in prompts]
    logits, cache, _ = runner.prefill(prompts)
    late_logits, late, _ = runner.prefill([[1, 12, 13]])  # a row that joins the running batch later
    worst = 0.0
    for step in range(6):
        if step == 2:
            logits, cache = torch.cat([logits, late_logits]), KVCache.concat([cache, late])
            seqs.append([1, 12, 13])
        for seq, row in zip(seqs, logits, strict=True):
            with torch.no_grad():
                reference = runner.model(torch.tensor([seq], device=device)).logits[0, -1].float()
            worst = max(worst, float((reference - row).abs().max()))
        tokens = logits.argmax(-1)
        for seq, token in zip(seqs, tokens.tolist(), strict=True):
            seq.append(token)
        logits = runner.decode(cache, tokens)
    print(f"{arch}: max abs logit diff vs transformers {worst:.2e}")
    assert worst < 1e-4


def test_an_architecture_outside_the_family_is_refused_by_name(tmp_path: Path) -> None:
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(**{**COMMON, "head_dim": 16})
    GemmaForCausalLM(config).save_pretrained(tmp_path / "gemma")
    build_tokenizer().save_pretrained(tmp_path / "gemma")
    with pytest.raises(ValueError, match="model_type 'gemma' is not supported; supported"):
        ModelRunner(str(tmp_path / "gemma"), "", "cpu", "float32")


@pytest.mark.parametrize("device", DEVICES)
def test_long_prompts_prefilled_alone_keep_their_order_and_match_transformers(
    tmp_path: Path, device: str
) -> None:
    runner = ModelRunner(str(write(tmp_path / "m", "qwen2_with_biases")), "", device, "float32")
    gen = torch.Generator().manual_seed(0)
    lengths = [300, 5, 270, 9, 5]
    prompts = [[1, *torch.randint(4, 16, (n - 1,), generator=gen).tolist()] for n in lengths]
    logits, cache, _ = runner.prefill_all(prompts)
    assert cache.lengths.tolist() == lengths
    tokens = logits.argmax(-1)
    after = runner.decode(cache, tokens)
    worst = 0.0
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([[*prompt, int(tokens[i])]], device=device)
            ref = runner.model(ids).logits[0, -2:].float()
        worst = max(
            worst, float((ref[0] - logits[i]).abs().max()), float((ref[1] - after[i]).abs().max())
        )
    assert worst < 1e-4


def test_dummy_load_format_reads_no_weights_and_serves_them_once_updated(tmp_path: Path) -> None:
    import shutil

    from services.engine.weights import read_checkpoint

    real = write(tmp_path / "real", "qwen2_with_biases")
    bare = tmp_path / "bare"  # config and tokenizer only, as a benchmark ships it
    shutil.copytree(real, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with pytest.raises(OSError):
        ModelRunner(str(bare), "", "cpu", "float32")  # auto must read weights, and finds none
    dummy = ModelRunner(str(bare), "", "cpu", "float32", load_format="dummy")
    loaded = ModelRunner(str(real), "", "cpu", "float32")
    assert dummy.parameter_shapes() == loaded.parameter_shapes()
    prompt = [[1, 4, 5, 6, 14]]
    assert not torch.equal(dummy.prefill(prompt)[0], loaded.prefill(prompt)[0])
    weights = read_checkpoint(str(real))
    dummy.check_weights((n, t.shape) for n, t in weights)
    dummy.load_weights(weights)
    torch.testing.assert_close(dummy.prefill(prompt)[0], loaded.prefill(prompt)[0])


def test_moe_experts_load_under_their_per_expert_checkpoint_names(tmp_path: Path) -> None:
    """Weight updates name each expert as the checkpoint (and SGLang's loader) does; they land
    in transformers' fused expert tensors."""
    from services.engine.weights import read_checkpoint

    runner = ModelRunner(str(write(tmp_path / "m", "qwen3_moe")), "", "cpu", "float32")
    shapes = runner.parameter_shapes()
    assert shapes["model.layers.1.mlp.experts.3.gate_proj.weight"] == (24, 64)
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 24)
    assert not any(n.endswith("gate_up_proj") for n in shapes)
    weights = dict(read_checkpoint(str(tmp_path / "m")))
    assert set(weights) == set(shapes)
    new_up = torch.randn(24, 64)
    runner.check_weights([("model.layers.1.mlp.experts.3.up_proj.weight", new_up.shape)])
    runner.load_weights([("model.layers.1.mlp.experts.3.up_proj.weight", new_up)])
    fused = runner.model.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(fused[3, 24:], new_up)
    assert torch.equal(fused[3, :24], weights["model.layers.1.mlp.experts.3.gate_proj.weight"])


def hf_routing(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """The experts transformers' own forward chooses at each position: `[positions, layers,
    top_k]`, each row sorted (the order within a top-k carries no meaning)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, 1).sort(-1).values


@pytest.mark.parametrize("prompt_cache_tokens", [0, 4096], ids=["no_prompt_cache", "prompt_cache"])
def test_generate_returns_the_experts_every_moe_layer_chose_at_every_position(
    tmp_path: Path, prompt_cache_tokens: int
) -> None:
    """`return_routed_experts` (SGLang's field): base64 int32 `[prompt + output - 1, layers,
    top_k]` from `routed_experts_start_len` on; equal to transformers' choices over the whole
    sequence, for rows prefilled together, decoded in one batch, with n > 1, and for a prompt
    served again from the prompt cache (its routing is kept with its keys)."""
    import asyncio
    import base64

    import numpy as np

    from services.engine.config import EngineConfig
    from services.engine.engine import Engine

    model_dir = write(tmp_path / "m", "qwen3_moe")
    engine = Engine(EngineConfig(model=str(model_dir), prompt_cache_tokens=prompt_cache_tokens))
    engine.start()
    try:
        prompts = [[1, 4, 5, 6, 14], [1, 9], [1, 7, 7, 8, 9, 10, 11, 14]]
        body = {
            "input_ids": prompts,
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 5, "n": 2, "ignore_eos": True},
        }
        out = asyncio.run(engine.generate(engine.parse(body)))
        sliced = asyncio.run(
            engine.generate(
                engine.parse({**body, "input_ids": prompts[2], "routed_experts_start_len": 3})
            )
        )
    finally:
        engine.stop()
    assert len(out) == 6
    for i, result in enumerate(out):
        tokens = prompts[i // 2] + result["output_ids"]
        raw = np.frombuffer(base64.b64decode(result["meta_info"]["routed_experts"]), np.int32)
        got = torch.from_numpy(raw.copy()).view(len(tokens) - 1, 2, 2).sort(-1).values
        assert torch.equal(got, hf_routing(model_dir, tokens)[:-1])
    assert sliced[0]["meta_info"]["cached_tokens"] == (
        len(prompts[2]) if prompt_cache_tokens else 0
    )
    tokens = prompts[2] + sliced[0]["output_ids"]
    raw = np.frombuffer(base64.b64decode(sliced[0]["meta_info"]["routed_experts"]), np.int32)
    assert torch.equal(
        torch.from_numpy(raw.copy()).view(-1, 2, 2).sort(-1).values,
        hf_routing(model_dir, tokens)[3:-1],
    )
