"""Each sample the router puts records the temperature its log-probs are of, and every token of
a sample is drawn at that one temperature, whatever a PATCH changes while it is generated."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from proto.run_terms import RunTerms
from services.rollout_router.config import RolloutConfig, SamplingConfig
from services.rollout_router.gateway.session_store import Session, session_samples
from services.rollout_router.rollout.control import filter_problem
from services.rollout_router.rollout.generation import Generation
from services.rollout_router.rollout.settings import LiveSettings
from services.rollout_router.samples import Partial


def output(ids: list[int], finish: str) -> dict[str, Any]:
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": finish},
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        },
    }


def test_a_sample_records_its_temperature_and_1_when_greedy() -> None:
    assert Partial.of(output([6, 2], "stop"), 0.7).to_sample([1], 1.0).temperature == 0.7
    # greedy: SGLang reports the log-probs of the unscaled logits
    assert Partial.of(output([6, 2], "stop"), 0.0).to_sample([1], 1.0).temperature == 1.0


class PatchingPool:
    """A worker pool whose first /generate returns one aborted sample and, while it is under
    way, sees the rollout temperature PATCHed to 1.3; it keeps every request's temperatures."""

    def __init__(self, live: LiveSettings) -> None:
        self.live, self.asked = live, []  # type: ignore[var-annotated]

    async def post_json(self, path: str, payload: dict, session_id: Any = None) -> tuple:
        params = payload["sampling_params"]
        params = params if isinstance(params, list) else [params]
        self.asked.append([p["temperature"] for p in params])
        worker = SimpleNamespace(weight_version=0)
        if len(self.asked) == 1:
            sampling = self.live.sampling.model_copy(update={"rollout_temperature": 1.3})
            self.live.sampling = sampling  # (as PATCH /rollout/config replaces it)
            return [output([6], "abort"), output([5, 2], "stop")], worker
        outs = [output([2], "stop") for _ in params]
        return (outs if len(outs) > 1 else outs[0]), worker


@pytest.mark.parametrize("partial_rollout", [True, False], ids=["continued", "started-over"])
def test_an_aborted_sample_redone_after_a_temperature_patch_is_asked_and_recorded_at_its_own(
    partial_rollout: bool,
) -> None:
    live = LiveSettings(
        RunTerms(n_samples_per_prompt=2),
        RolloutConfig(partial_rollout=partial_rollout),
        SamplingConfig(rollout_max_response_len=4, rollout_temperature=0.7),
    )
    pool = PatchingPool(live)
    observe = SimpleNamespace(request_seconds=SimpleNamespace(observe=lambda _s: None))
    gen = Generation(live, pool, [2], observe)  # type: ignore[arg-type]
    partials = asyncio.run(gen.partials([1, 5, 14], seed=1))
    assert pool.asked == [[0.7, 0.7], [0.7]]  # redone at the sample's 0.7, not 1.3
    samples = [p.to_sample([1, 5, 14], 0.0) for p in partials]
    assert [s.response_ids for s in samples] == [[6, 2] if partial_rollout else [2], [5, 2]]
    assert [s.temperature for s in samples] == [0.7, 0.7]
    later = asyncio.run(gen.partials([1, 5, 14], seed=2))  # the next group: the new setting
    assert pool.asked[-1] == [1.3, 1.3]
    assert [p.to_sample([1], 0.0).temperature for p in later] == [1.3, 1.3]


def test_a_session_turn_at_another_temperature_starts_a_sample_of_its_own() -> None:
    session = Session("s")
    for prompt, ids, temperature in [
        ([1, 5, 14], [6, 2], 0.7),
        ([1, 5, 14, 6, 2, 7, 14], [8, 2], 0.7),  # extends turn 1 at its temperature: merged
        ([1, 5, 14, 6, 2, 7, 14, 8, 2, 9, 14], [4, 2], 1.0),  # extends it at another one
    ]:
        session.record(prompt, Partial.of(output(ids, "stop"), temperature))
    first, second = session_samples(session, reward=0.5)
    assert (first.prompt_ids, first.response_ids) == ([1, 5, 14], [6, 2, 7, 14, 8, 2])
    assert first.loss_mask == [1, 1, 0, 0, 1, 1] and first.temperature == 0.7
    assert second.prompt_ids == [1, 5, 14, 6, 2, 7, 14, 8, 2, 9, 14]  # the whole context
    assert (second.response_ids, second.loss_mask, second.temperature) == ([4, 2], [1, 1], 1.0)


def test_filtered_rollouts_are_refused_naming_the_flag() -> None:
    assert filter_problem(SamplingConfig(rollout_temperature=0.7)) == ""
    top_p = filter_problem(SamplingConfig(rollout_top_p=0.9))
    assert top_p.startswith("--rollout-top-p 0.9: rollouts are trained on") and "top_p" in top_p
    top_k = filter_problem(SamplingConfig(rollout_top_k=20))
    assert top_k.startswith("--rollout-top-k 20: rollouts are trained on")
    assert top_k.endswith("leave --rollout-top-k at -1")
