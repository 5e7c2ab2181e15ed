"""The sampler as pure logic: filters, seeded streams, logprobs of the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.sampling import (
    RequestError,
    SamplingParams,
    derive_seed,
    row_params,
    sample,
)

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))


def draw(
    params: SamplingParams, seeds: range, logits: torch.Tensor = LOGITS
) -> tuple[set[int], list[float]]:
    rows = row_params([params] * len(seeds), list(seeds), [0] * len(seeds), [[]] * len(seeds), 4)
    tokens, logprobs, _ = sample(logits.expand(len(seeds), -1), rows)
    return set(tokens.tolist()), logprobs.tolist()


def test_top_k_samples_the_k_most_likely_and_reports_unfiltered_logprobs_as_sglang() -> None:
    tokens, logprobs = draw(SamplingParams(top_k=2), range(400))
    assert tokens == {0, 1}
    # SGLang reports log_softmax(logits / T) before the filter, not renormalized over the kept
    assert {round(lp, 5) for lp in logprobs} == {round(math.log(0.5), 5), round(math.log(0.25), 5)}


def test_top_p_with_temperature_reports_temperature_scaled_unfiltered_logprobs() -> None:
    tokens, logprobs = draw(SamplingParams(top_p=0.8, temperature=0.5), range(400))
    expected = torch.log_softmax(LOGITS[0] / 0.5, -1)
    assert tokens == {0, 1}
    assert {round(lp, 5) for lp in logprobs} == {round(float(expected[t]), 5) for t in (0, 1)}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    tokens, _ = draw(SamplingParams(top_p=0.7), range(400))
    assert tokens == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    tokens, _ = draw(SamplingParams(min_p=0.4), range(400))
    assert tokens == {0, 1}


def test_unfiltered_sampling_reaches_every_token_with_plain_logprobs() -> None:
    tokens, logprobs = draw(SamplingParams(), range(400))
    assert tokens == {0, 1, 2, 3}
    expected = torch.log_softmax(LOGITS[0], -1)
    assert all(min(abs(lp - float(e)) for e in expected) < 1e-6 for lp in logprobs)


def test_greedy_picks_the_argmax_and_reports_the_unscaled_logprob() -> None:
    tokens, logprobs = draw(SamplingParams(temperature=0), range(10))
    assert tokens == {0}
    assert logprobs == pytest.approx([math.log(0.5)] * 10, abs=1e-6)


def test_a_row_draws_the_same_token_whatever_its_batch_mates() -> None:
    params = SamplingParams(temperature=0.8)
    seed = derive_seed(42, 0)
    alone = row_params([params], [seed], [3], [[]], 4)
    mates = [
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.5),
        params,
        SamplingParams(temperature=2),
    ]
    batch = row_params(mates, [1, 2, seed, 3], [0, 9, 3, 5], [[], [], [], []], 4)
    logits = torch.randn(4, 4)
    assert sample(logits[2:3], alone)[0].item() == sample(logits, batch)[0][2].item()


def test_parallel_samples_get_distinct_seeds_reproducible_from_sampling_seed() -> None:
    seeds = [derive_seed(7, i) for i in range(8)]
    assert len(set(seeds)) == 8
    assert seeds == [derive_seed(7, i) for i in range(8)]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"top_k": 0}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_p": 2}, "min_p"),
        ({"stop": [1]}, "stop"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(raw: dict, field: str) -> None:
    with pytest.raises(RequestError, match=field):
        SamplingParams.from_json(raw)
