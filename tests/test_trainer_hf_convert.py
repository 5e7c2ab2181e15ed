"""HF <-> megatron conversion: logits equal `transformers`, export round-trips, packed = unpacked.

These tests build megatron models in the pytest process (gloo world of one).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.trainer import batching, cpu_compat, hf_convert
from services.trainer.config import TrainerConfig
from services.trainer.policy import Policy, init_distributed
from tandem.toy_model import build_tokenizer
from tests.tiny_models import TINY, write_tiny

IDS = torch.tensor([[1, 5, 6, 14, 6, 5, 2, 7, 8, 9, 3]])


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    """A gloo world of one in this process; the CPU compatibility mode is removed afterwards
    so that tests of other modules run without it."""
    torch.set_num_threads(1)
    init_distributed(tp_size=1, seed=0)
    yield
    cpu_compat.uninstall()


@pytest.fixture(scope="module")
def qwen2_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (qkv bias, tied embeddings, vocab not a multiple of 128)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=37,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random biases, so a wrong bias layout shows in the logits
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    out = tmp_path_factory.mktemp("qwen2") / "model"
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)  # for the engine
    return out


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny checkpoint of `tests.tiny_models` (Qwen3 tied and untied, Mistral, Qwen3-MoE
    with and without top-k renormalization)."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny(root / name, name) for name in TINY}


CHECKPOINTS = ["toy_llama", "qwen2_tied_bias", *TINY]


@pytest.fixture(params=CHECKPOINTS)
def checkpoint(
    request: pytest.FixtureRequest,
    megatron_world: None,
    toy_model_dir: Path,
    qwen2_tied_dir: Path,
    tiny_dirs: dict[str, Path],
) -> tuple[Path, Policy]:
    """Each HF test checkpoint with a (non-training) policy loaded from it."""
    model_dir = {"toy_llama": toy_model_dir, "qwen2_tied_bias": qwen2_tied_dir, **tiny_dirs}[
        request.param
    ]
    return model_dir, Policy(TrainerConfig(model=str(model_dir)), str(model_dir), train=False)


@pytest.fixture(scope="module")
def llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with Llama-3.1-style RoPE scaling and a long context."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16384,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )
    torch.manual_seed(2)
    out = tmp_path_factory.mktemp("llama3") / "model"
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def test_llama3_rope_scaling_matches_transformers_at_long_positions(
    megatron_world: None, llama3_rope_dir: Path
) -> None:
    policy = Policy(TrainerConfig(model=str(llama3_rope_dir)), str(llama3_rope_dir), train=False)
    assert policy.arch.rope_scaling_factor == 8.0
    ids = torch.randint(0, 40, (1, 3000), generator=torch.Generator().manual_seed(0))
    reference = hf_logits(llama3_rope_dir, ids)
    assert (megatron_logits(policy, ids) - reference).abs().max().item() < 1e-6
    unscaled = replace(policy.arch, rope_scaling_factor=0.0)
    plain = hf_convert.build_gpt_model(unscaled, hf_convert.transformer_config(unscaled), 128)
    hf_convert.load_hf_into_model(plain, unscaled, hf_convert.load_hf_state(llama3_rope_dir))
    policy.model = plain  # the same weights without scaling must be measurably different
    assert (megatron_logits(policy, ids) - reference).abs().max().item() > 1e-4


def test_unsupported_rope_scaling_is_refused_naming_the_file(tmp_path: Path) -> None:
    config = {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: rope scaling"):
        hf_convert.read_hf_arch(tmp_path)


def hf_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def megatron_logits(policy: Policy, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = policy.model(
            input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], attention_mask=None
        )
    return out[..., : policy.arch.vocab_size]


def test_megatron_logits_equal_transformers_logits_on_the_same_weights(
    checkpoint: tuple[Path, Policy],
) -> None:
    model_dir, policy = checkpoint
    ids = IDS.clamp(max=policy.arch.vocab_size - 1)
    diff = (megatron_logits(policy, ids) - hf_logits(model_dir, ids)).abs().max().item()
    assert diff < 1e-5


def test_the_engine_scores_tokens_as_transformers_and_the_trainer_do(
    checkpoint: tuple[Path, Policy],
) -> None:
    """Three implementations of one checkpoint: transformers, the trainer's megatron model
    after conversion, and the reference engine's own forward (prefill with scoring)."""
    from services.engine.model_runner import ModelRunner

    model_dir, policy = checkpoint
    ids = IDS.clamp(max=policy.arch.vocab_size - 1)
    reference = hf_logits(model_dir, ids)[0]
    runner = ModelRunner(str(model_dir), "", "cpu", "float32")
    last, _, scores = runner.prefill([ids[0].tolist()], [(1, 1.0)])
    engine_logp = torch.tensor(scores[0])
    trainer_logp = megatron_logits(policy, ids)[0].log_softmax(-1)[:-1].gather(1, ids[0, 1:, None])
    hf_logp = reference.log_softmax(-1)[:-1].gather(1, ids[0, 1:, None])
    assert (last[0] - reference[-1]).abs().max().item() < 1e-4
    assert (engine_logp - hf_logp[:, 0]).abs().max().item() < 1e-4
    assert (trainer_logp - hf_logp).abs().max().item() < 1e-4


def test_export_to_hf_names_round_trips_exactly(checkpoint: tuple[Path, Policy]) -> None:
    model_dir, policy = checkpoint
    original = hf_convert.load_hf_state(model_dir)
    exported = dict(policy.export_hf())
    expected = {
        k: v
        for k, v in original.items()
        if not (policy.arch.tie_word_embeddings and k == "lm_head.weight")
    }
    assert set(exported) == set(expected)
    assert all(torch.equal(exported[k], expected[k]) for k in expected)


def test_on_device_export_is_the_same_tensors_each_time_and_follows_the_weights(
    checkpoint: tuple[Path, Policy],
) -> None:
    _, policy = checkpoint
    model, arch = policy.model, policy.arch

    def check(exported: list[tuple[str, torch.Tensor]]) -> None:
        copies = hf_convert.export_hf(model, arch)  # CPU copies, the reference
        assert [n for n, _ in exported] == [n for n, _ in copies]
        for (name, got), (_, want) in zip(exported, copies, strict=True):
            assert got.is_contiguous() and torch.equal(got.cpu(), want), name

    first = hf_convert.export_hf(model, arch, on_device=True)
    check(first)  # on CUDA, later refreshes replay a CUDA graph of the gathers and copies
    with torch.no_grad():  # an optimizer step: in place, same storage
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    second = hf_convert.export_hf(model, arch, on_device=True)
    assert all(a is b for (_, a), (_, b) in zip(first, second, strict=True))
    check(second)  # the views follow; q, k, v buffers were refreshed
    qkv = next(p for n, p in model.named_parameters() if n.endswith("linear_qkv.weight"))
    qkv.data = qkv.data.clone() * 2  # new storage: the cached export is rebuilt
    third = hf_convert.export_hf(model, arch, on_device=True)
    assert not all(a is b for (_, a), (_, b) in zip(first, third, strict=True))
    check(third)
    halves = hf_convert.export_hf(model, arch, dtype=torch.bfloat16, on_device=True)
    assert all(t.dtype == torch.bfloat16 for _, t in halves)
    assert all(torch.equal(h, t.bfloat16()) for (_, h), (_, t) in zip(halves, third, strict=True))


def test_a_naive_qkv_split_would_be_wrong_so_the_interleave_matters(toy_model_dir: Path) -> None:
    arch = hf_convert.read_hf_arch(toy_model_dir)
    q, k, v = (
        torch.randn(n * arch.head_dim, 4)
        for n in (arch.num_heads, arch.num_kv_heads, arch.num_kv_heads)
    )
    qkv = hf_convert._interleave_qkv(arch, q, k, v)
    assert not torch.equal(qkv, torch.cat([q, k, v]))
    back = hf_convert._split_qkv(arch, qkv)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


def test_tp_shards_of_fc1_hold_their_own_gate_and_up_halves() -> None:
    full = torch.arange(8.0).reshape(8, 1)  # gate = 0..3, up = 4..7
    shards = [
        hf_convert.shard("decoder.layers.0.mlp.linear_fc1.weight", full, r, 2) for r in range(2)
    ]
    assert shards[0].flatten().tolist() == [0, 1, 4, 5]
    assert torch.equal(hf_convert.unshard("decoder.layers.0.mlp.linear_fc1.weight", shards), full)


def test_packed_logprobs_equal_padded_logprobs(megatron_world: None, toy_model_dir: Path) -> None:
    from proto import Sample, SampleGroup

    samples_in = [
        Sample(
            prompt_ids=[1, 4 + a, 4 + b, 14],
            response_ids=[4 + b, 4 + a, 2][: 1 + (a % 3)],
            response_logprobs=[0.0] * (1 + a % 3),
            loss_mask=[1] * (1 + a % 3),
            reward=0.0,
            weight_version=0,
        )
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
    ]
    groups = [
        SampleGroup(
            group_id="g", prompt="", label="", samples=samples_in, weight_version=0, created_at=0.0
        )
    ]
    samples = batching.flatten(groups, batching.compute_advantages(groups, "grpo", True, 1e-6))
    policy = Policy(TrainerConfig(model=str(toy_model_dir)), str(toy_model_dir), train=False)
    packed = batching.make_micro_batches(samples, True, 64, 4)
    padded = batching.make_micro_batches(samples, False, 64, 4)
    assert len(packed) == 1 and packed[0].input_ids.shape[0] == 1
    lp_packed = policy.logprobs(packed)[0]["logp"][packed[0].loss_mask > 0]
    lp_padded = policy.logprobs(padded)[0]["logp"][padded[0].loss_mask > 0]
    assert lp_packed.numel() == sum(len(s.response_ids) for s in samples_in)
    assert (lp_packed - lp_padded).abs().max().item() < 1e-5


def test_micro_batches_equalized_for_expert_parallelism_keep_each_samples_logprobs(
    megatron_world: None, toy_model_dir: Path
) -> None:
    """`batching.equalize` (every EP rank: same number of micro-batches, same length) adds a
    padding segment and all-padding micro-batches; the samples' log-probs do not move."""
    from proto import Sample, SampleGroup

    samples_in = [
        Sample(
            prompt_ids=[1, 4 + a, 14],
            response_ids=[4 + a, 2][: 1 + a % 2],
            response_logprobs=[0.0] * (1 + a % 2),
            loss_mask=[1] * (1 + a % 2),
            reward=float(a),
            weight_version=0,
        )
        for a in range(5)
    ]
    group = SampleGroup(
        group_id="g", prompt="", label="", samples=samples_in, weight_version=0, created_at=0.0
    )
    samples = batching.flatten([group], batching.compute_advantages([group], "grpo", True, 1e-6))
    policy = Policy(TrainerConfig(model=str(toy_model_dir)), str(toy_model_dir), train=False)
    plain = batching.make_micro_batches(samples, True, 8, 4)
    outs = policy.logprobs(plain)
    reference = [out["logp"][mb.loss_mask > 0] for mb, out in zip(plain, outs, strict=True)]
    equal = batching.equalize(batching.make_micro_batches(samples, True, 8, 4), len(plain) + 2, 11)
    assert len(equal) == len(plain) + 2
    assert all(mb.input_ids.shape == (1, 11) for mb in equal)
    assert [mb.padding for mb in equal] == [False] * len(plain) + [True, True]
    outs = policy.logprobs(equal)
    for mb, out, want in zip(equal, outs, [*reference, None, None], strict=True):
        got = out["logp"][mb.loss_mask > 0]
        if want is None:
            assert got.numel() == 0 and mb.num_tokens == 0
        else:
            assert (got - want).abs().max().item() < 1e-6
            assert mb.num_tokens == sum(samples[i].input_len for i in mb.sample_index)


def test_packed_logits_equal_each_sample_run_alone(
    megatron_world: None, toy_model_dir: Path
) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    policy = Policy(TrainerConfig(model=str(toy_model_dir)), str(toy_model_dir), train=False)
    rng = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 16, (n,), generator=rng) for n in (5, 9, 5, 3, 12)]
    cu = torch.tensor(
        [0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32
    )
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12
    )
    packed_ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        packed = policy.model(
            input_ids=packed_ids,
            position_ids=positions,
            attention_mask=None,
            packed_seq_params=params,
        )
    alone = torch.cat([megatron_logits(policy, s[None])[0] for s in seqs])
    assert (packed[0, :, :16] - alone).abs().max().item() < 1e-5


class _NoContextParallel:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def test_packed_rope_equals_megatrons_thd_rope_values_and_gradients() -> None:
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    from services.trainer.packed_attention import packed_rope

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 6, 17, 30], dtype=torch.int32)
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    angles = torch.outer(torch.arange(20).float(), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # megatron's [s, 1, 1, d]
    t = torch.randn(30, 4, 8, generator=gen, dtype=torch.float64).requires_grad_()
    ref_t = t.detach().clone().requires_grad_()
    ours = packed_rope(t, freqs.double(), config, cu_seqlens=cu)
    ref = rope_utils._apply_rotary_pos_emb_thd(
        ref_t, cu, freqs.double(), cp_group=_NoContextParallel()
    )
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    grad = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    ours.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(t.grad, ref_t.grad, rtol=0, atol=1e-12)
    # a second micro-batch with other lengths must not reuse the first one's positions
    cu2 = torch.tensor([0, 12, 30], dtype=torch.int32)
    again = packed_rope(t.detach(), freqs.double(), config, cu_seqlens=cu2)
    ref2 = rope_utils._apply_rotary_pos_emb_thd(
        t.detach(), cu2, freqs.double(), cp_group=_NoContextParallel()
    )
    torch.testing.assert_close(again, ref2, rtol=0, atol=1e-12)


def test_a_sharded_model_is_read_by_its_index_only_and_a_missing_shard_is_named(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    """Mistral's repositories hold `consolidated.safetensors` (the same weights, other names)
    beside the indexed shards: the trainer read it too (twice the memory of a 7B model's
    load); a shard the index lists but the folder lacks (a download cut short) is named."""
    import shutil

    from safetensors.torch import load_file, save_file

    from services.engine.weights import read_checkpoint

    folder = tmp_path / "sharded"
    shutil.copytree(toy_model_dir, folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    shards = {n: f"model-0000{1 + k % 2}-of-00002.safetensors" for k, n in enumerate(names)}
    for shard in set(shards.values()):
        save_file({n: state[n] for n in names if shards[n] == shard}, folder / shard)
    index = {"metadata": {}, "weight_map": shards}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(
        {f"other.{n}": t.clone() for n, t in state.items()}, folder / "consolidated.safetensors"
    )
    for read in (hf_convert.load_hf_state, lambda f: dict(read_checkpoint(str(f)))):
        loaded = read(folder)
        assert set(loaded) == set(state)
        assert all(torch.equal(loaded[n], state[n]) for n in names)
    (folder / "model-00002-of-00002.safetensors").unlink()
    for read in (hf_convert.load_hf_state, read_checkpoint):
        with pytest.raises(
            ValueError,
            match="lists 1 weight files that are not in the folder "
            r"\(the first: model-00002-of-00002.safetensors\): a download cut",
        ):
            read(folder)
    from tandem import launcher  # (tandem up: before anything starts)

    _config, problems = launcher.parse(["--model", str(folder)])
    assert any("(the first: model-00002-of-00002.safetensors)" in p for p in problems), problems
