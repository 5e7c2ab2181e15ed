"""The trainer scores each sample under the distribution it was drawn from.

The reference engine in this process samples the toy model at a temperature and reports
SGLang's log-probs, `log_softmax(logits / T)`; the samples go through the trainer's batching
into a megatron policy, whose log-probs must equal the engine's (< 1e-3 in fp32), at 0.7 and
with several temperatures in one micro-batch (a temperature changed mid-run).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from proto import Sample, SampleGroup
from proto.drops import DeadLetterReason
from proto.packed import decode_entry, encode_entry, pack, unpack
from services.trainer import batching, intake
from services.trainer.config import TrainerConfig
from services.trainer.policy import Policy
from tests.test_trainer_hf_convert import megatron_world  # noqa: F401 - fixture

PROMPTS = [[1, 4, 5, 14], [1, 9, 9, 14], [1, 7, 8, 14]]
BOUND = 1e-3  # trainer/engine log-prob bound in fp32 (the step-0 and same-version bound)


def engine_samples(model_dir: Path, temperature: float) -> list[Sample]:
    """Three samples a prompt, drawn by the reference engine at `temperature` as the router
    records them (the sample's temperature set)."""
    from services.engine.config import EngineConfig
    from services.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(model_dir), prompt_cache_tokens=0))
    engine.start()
    body = {
        "input_ids": PROMPTS,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": 6,
            "n": 3,
            "ignore_eos": True,
            "sampling_seed": 3,
            "temperature": temperature,
        },
    }
    try:
        outs = asyncio.run(engine.generate(engine.parse(body)))
    finally:
        engine.stop()
    return [
        Sample(
            prompt_ids=PROMPTS[i // 3],
            response_ids=out["output_ids"],
            response_logprobs=[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
            loss_mask=[1] * len(out["output_ids"]),
            reward=float(i % 2),
            weight_version=0,
            temperature=temperature,
        )
        for i, out in enumerate(outs)
    ]


def micro_batches(samples: list[Sample], packed: bool) -> list[batching.MicroBatch]:
    group = SampleGroup(
        group_id="g", prompt="", label="", samples=samples, weight_version=0, created_at=0.0
    )
    groups = [pack(group)]  # as the trainer reads them from the buffer
    train = batching.flatten(groups, batching.compute_advantages(groups, "grpo", True, 1e-6))
    return batching.make_micro_batches(train, packed, 512, 4)


def logprob_diff(policy: Policy, samples: list[Sample], packed: bool) -> float:
    """Max |trainer - engine| log-prob over every response token."""
    worst = 0.0
    mbs = micro_batches(samples, packed)
    for mb, out in zip(mbs, policy.logprobs(mbs), strict=True):
        mask = mb.loss_mask > 0
        worst = max(worst, (out["logp"][mask] - mb.behaviour_logp[mask]).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def policy(megatron_world: None, toy_model_dir: Path) -> Policy:  # noqa: F811
    return Policy(TrainerConfig(model=str(toy_model_dir)), str(toy_model_dir), train=False)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_the_trainers_log_probs_of_samples_drawn_at_temperature_0_7_equal_the_engines(
    policy: Policy, toy_model_dir: Path, packed: bool
) -> None:
    samples = engine_samples(toy_model_dir, 0.7)
    diff = logprob_diff(policy, samples, packed)
    untempered = [msgspec.structs.replace(s, temperature=1.0) for s in samples]
    off = logprob_diff(policy, untempered, packed)  # what a trainer without temperature scores
    print(f"T=0.7: max |trainer - engine| log-prob {diff:.2e}; scored at T=1 {off:.3f}")
    assert diff < BOUND
    assert off > 100 * BOUND  # the test tells the two apart


def test_samples_of_several_temperatures_in_one_micro_batch_are_each_scored_at_their_own(
    policy: Policy, toy_model_dir: Path
) -> None:
    """A temperature changed mid-run: samples of the old and the new one train together."""
    mixed = [*engine_samples(toy_model_dir, 0.7), *engine_samples(toy_model_dir, 1.0)]
    mixed += engine_samples(toy_model_dir, 1.5)
    mbs = micro_batches(mixed, packed=True)
    assert len(mbs) == 1 and mbs[0].temperature is not None
    assert sorted(set(mbs[0].temperature.flatten().tolist())) == pytest.approx([0.7, 1.0, 1.5])
    assert logprob_diff(policy, mixed, packed=True) < BOUND
    assert logprob_diff(policy, mixed, packed=False) < BOUND


def test_the_entropy_the_trainer_reports_is_the_tempered_distributions(
    policy: Policy, toy_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    samples = engine_samples(toy_model_dir, 0.7)[:3]
    mb = micro_batches(samples, packed=False)[0]
    entropy = policy.logprobs([mb], with_entropy=True)[0]["entropy"]
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    for row, start, stop in mb.response_spans:
        ids = mb.input_ids[row : row + 1, :stop]
        with torch.no_grad():
            logp = (model(ids).logits[0, start:stop] / 0.7).log_softmax(-1)
        want = -(logp.exp() * logp).sum(-1)
        assert torch.allclose(entropy[row, start:stop], want, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tempered_log_probs_and_their_gradients_are_those_of_the_divided_logits(
    megatron_world: None,  # noqa: F811 - the imported fixture
    dtype: torch.dtype,
) -> None:
    from services.trainer.policy import token_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    temperature = torch.tensor([[0.7] * 5, [1.3] * 3 + [1.0] * 2])
    logp, entropy = token_logprobs(logits, targets, 11, True, True, temperature)
    assert entropy is not None
    (logp.sum() + entropy.sum()).backward()
    leaf = logits.detach().float().requires_grad_()
    want = (leaf / temperature.unsqueeze(-1)).log_softmax(-1)
    want_entropy = -(want.exp() * want).sum(-1)
    (want.gather(-1, targets.unsqueeze(-1)).sum() + want_entropy.sum()).backward()
    assert torch.allclose(logp, want.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-5)
    assert torch.allclose(entropy, want_entropy, atol=1e-5)
    assert logits.grad is not None and leaf.grad is not None
    assert torch.allclose(
        logits.grad.float(), leaf.grad, atol=1e-2 if dtype != torch.float32 else 1e-5
    )


def test_a_micro_batch_of_temperature_1_divides_nothing_and_padding_is_at_1() -> None:
    def train_sample(n: int, temperature: float) -> batching.TrainSample:
        ones = np.ones(n, np.float32)
        tokens = np.arange(2 + n)
        return batching.TrainSample(tokens, 2, ones, ones, ones, 0, 0.0, temperature=temperature)

    plain = [train_sample(3, 1.0), train_sample(2, 1.0)]
    assert batching.build_micro_batch(plain, [0, 1], packed=True).temperature is None
    hot = [train_sample(3, 0.5), train_sample(1, 1.0)]
    padded = batching.build_micro_batch(hot, [0, 1], packed=False)
    assert padded.temperature is not None
    assert padded.temperature.tolist() == [[0.5] * 4, [1.0] * 4]  # row 2's padding at 1
    packed = batching.build_micro_batch(hot, [0, 1], packed=True)
    (equal,) = batching.equalize([packed], 1, 9)
    assert equal.temperature is not None
    assert equal.temperature.tolist() == [[0.5] * 4 + [1.0] * 5]  # the added segment at 1


def test_a_samples_temperature_survives_the_buffers_form_and_an_entry_without_it_reads_as_1() -> (
    None
):
    sample = Sample(
        prompt_ids=[1, 2],
        response_ids=[3],
        response_logprobs=[-0.5],
        loss_mask=[1],
        reward=1.0,
        weight_version=0,
        temperature=0.7,
    )
    group = SampleGroup(
        group_id="g", prompt="", label="", samples=[sample], weight_version=0, created_at=0.0
    )
    (read,) = decode_entry(encode_entry([pack(group)]))  # type: ignore[misc]
    assert read.samples[0].temperature == pytest.approx(0.7)
    assert unpack(read).samples[0].temperature == pytest.approx(0.7)
    old = msgspec.msgpack.encode(
        [["g", "", "", [[b"\1\0\0\0", b"", b"", b"", b"", 1.0, 0, "stop", "", b""]], 0, 0.0, 1]]
    )
    (before,) = decode_entry(old)  # type: ignore[misc]
    assert before.samples[0].temperature == 1.0


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf])
def test_a_sample_whose_temperature_the_trainer_cannot_divide_by_is_dead_lettered(
    temperature: float,
) -> None:
    sample = Sample(
        prompt_ids=[1, 2],
        response_ids=[3],
        response_logprobs=[-0.5],
        loss_mask=[1],
        reward=1.0,
        weight_version=0,
        temperature=temperature,
    )
    group = pack(
        SampleGroup(
            group_id="g", prompt="", label="", samples=[sample], weight_version=0, created_at=0.0
        )
    )
    limits = intake.Limits(vocab_size=16, max_tokens=64, max_response_len=8)
    (why,) = intake.check_groups([group], limits, version=0)
    assert isinstance(why, intake.Rejected)
    assert (
        why.reason == DeadLetterReason.BAD_TEMPERATURE
        and f"temperature {temperature}" in why.detail
    )
    fine = pack(
        SampleGroup(
            **{
                **msgspec.structs.asdict(unpack(group)),
                "samples": [msgspec.structs.replace(sample, temperature=0.7)],
            }
        )
    )
    assert intake.check_groups([fine], limits, version=0) == [fine]
