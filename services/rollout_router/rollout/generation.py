"""The rollout's /generate requests: bodies with the run's sampling settings (samples.py), sent
through the worker pool (retried across engines) under `rollout_max_concurrency`, and aborted
samples continued (partial rollout) or started over, at most `max_continues` times. An
environment episode's turns stop where its sample would outgrow the model's context or, for
training, what the trainer takes (its stated `SampleLimits`): cut there, it is trained."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from proto import DropReason
from proto.contract import SampleLimits
from services.rollout_router.balancer.worker import EngineRequestError
from services.rollout_router.balancer.workers import WorkerPool
from services.rollout_router.rollout.environments import ContextFullError, EnvError, Generate
from services.rollout_router.rollout.limiter import Limiter
from services.rollout_router.rollout.metrics import LoopObserver
from services.rollout_router.rollout.settings import LiveSettings
from services.rollout_router.samples import (
    Partial,
    as_list,
    generate_body,
    parse_version,
    sampling_seed,
)


class Generation:
    """The rollout loop's and the evaluations' requests to the engines."""

    def __init__(
        self,
        live: LiveSettings,
        pool: WorkerPool,
        stop_token_ids: list[int],
        observe: LoopObserver,
    ) -> None:
        self.live, self.pool = live, pool  # (settings read at each request: a PATCH applies)
        self.stop_token_ids, self.observe = stop_token_ids, observe
        self.context_len = 0  # the model's positions (0 = unknown): an episode's turns fit in it
        self.limits: SampleLimits | None = None  # the trainer's (the rollout loop reads them)
        self.in_flight = 0  # /generate requests
        self.limiter = Limiter(live.rollout.rollout_max_concurrency)

    def settings_changed(self) -> None:
        """The live settings were replaced: requests waiting now see the new concurrency."""
        self.limiter.set_limit(self.live.rollout.rollout_max_concurrency)

    def payload(
        self,
        input_ids: list[int],
        n: int,
        max_new: int,
        greedy: bool,
        seed: int,
        bound: int = 0,
        temperature: float | None = None,
    ) -> dict:
        """One /generate body with this loop's sampling settings (`samples.generate_body`),
        at `temperature` if given (a sample's own, kept when the settings change under it);
        prompt and response within `bound` tokens (0: the model's context)."""
        if bound := bound or self.context_len:  # an episode's later turns get what is left
            max_new = max(1, min(max_new, bound - len(input_ids)))
        sampling = self.live.sampling
        if temperature is not None:
            sampling = sampling.model_copy(update={"rollout_temperature": temperature})
        return generate_body(sampling, self.stop_token_ids, input_ids, n, max_new, greedy, seed)

    async def generate(
        self, payload: dict[str, Any], session_id: str | None = None
    ) -> list[dict[str, Any]]:
        """One /generate (retried across engines by the pool); notes the reported versions.
        `session_id` keeps an episode's turns on one engine under session affinity."""
        async with self.limiter:
            self.in_flight += 1
            started = time.monotonic()
            try:
                data, worker = await self.pool.post_json("/generate", payload, session_id)
            finally:
                self.in_flight -= 1
            self.observe.request_seconds.observe(time.monotonic() - started)
        outs = as_list(data)
        for out in outs:
            v = parse_version(out.get("meta_info", {}).get("weight_version"))
            worker.weight_version = max(worker.weight_version, v)
        return outs

    async def partials(self, prompt_ids: list[int], seed: int) -> list[Partial]:
        """The `n_samples_per_prompt` samples of one prompt, the aborted ones completed (some
        may still be aborted after `max_continues` tries)."""
        n, max_new = (
            self.live.run.n_samples_per_prompt,
            self.live.sampling.rollout_max_response_len,
        )
        temperature = self.live.sampling.rollout_temperature  # (the group's, to its end)
        payload = self.payload(prompt_ids, n, max_new, False, seed, temperature=temperature)
        outs = await self.generate(payload)
        if len(outs) != n:
            raise EngineRequestError(f"engine returned {len(outs)} samples, asked for {n}")
        partials = [Partial.of(out, temperature) for out in outs]
        aborted = [k for k, p in enumerate(partials) if p.finish == "abort"]
        if aborted:  # only these need more requests; tasks for the rest would be pure overhead
            redone = await asyncio.gather(
                *(self.complete(prompt_ids, partials[k], seed + k) for k in aborted)
            )
            for k, partial in zip(aborted, redone, strict=True):
                partials[k] = partial
        return partials

    def episode_turn(self, episode_id: str, greedy: bool = False) -> Generate:
        """The model-turn function of one episode (its turns stay on one engine). A greedy
        one is an evaluation's, never trained: only the model's context bounds it."""
        max_new = self.live.sampling.rollout_max_response_len
        bound: list[tuple[int, str]] = []  # set at the first turn, whose context is the prompt
        # every turn at the episode's first temperature: they make one sample
        temperature = 0.0 if greedy else self.live.sampling.rollout_temperature

        async def turn(context: list[int], turn_seed: int) -> Partial:
            if not bound:
                bound.append(self.episode_bound(len(context), greedy))
            tokens, what = bound[0]
            if tokens and len(context) >= tokens:
                raise ContextFullError(len(context), tokens, what)
            payload = self.payload(context, 1, max_new, greedy, turn_seed, tokens, temperature)
            out = await self.generate(payload, episode_id)
            first = Partial.of(out[0], temperature)
            partial = await self.complete(context, first, turn_seed, episode_id)
            if partial.finish == "abort":
                raise EnvError(DropReason.ABORTED, "a model turn stayed aborted")
            return partial

        return turn

    def episode_bound(self, prompt_len: int, greedy: bool) -> tuple[int, str]:
        """(tokens, what bounds them) of an episode whose prompt is `prompt_len` tokens long:
        the model's context, and for training the trainer's limits; (0, "") when unknown."""
        n = self.context_len
        bounds = [(n, f"the model's context of {n} positions (max_position_embeddings)")]
        if self.limits is not None and not greedy:
            n = self.limits.max_tokens
            bounds.append((n, f"the {n} tokens the trainer takes (--max-tokens-per-gpu)"))
            n = prompt_len + self.limits.max_response_len
            bounds.append((n, f"the {n} of the prompt and the trainer's --max-response-len"))
        return min(((n, what) for n, what in bounds if n > 0), default=(0, ""))

    async def complete(
        self, prompt_ids: list[int], partial: Partial, seed: int, session_id: str | None = None
    ) -> Partial:
        """Continue (partial rollout) or restart an aborted sample, at most `max_continues`
        times. A continuation sends prompt + the tokens so far and asks for the rest, at the
        sample's temperature (a PATCH since changes the next samples, not this one)."""
        max_new = self.live.sampling.rollout_max_response_len
        while partial.finish == "abort" and partial.continues < self.live.rollout.max_continues:
            partial.continues += 1
            seed, t = sampling_seed(seed, partial.continues), partial.temperature
            # start over: the aborted tokens are discarded
            if not self.live.rollout.partial_rollout:
                payload = self.payload(prompt_ids, 1, max_new, False, seed, temperature=t)
                out = await self.generate(payload, session_id)
                partial = dataclasses.replace(Partial.of(out[0], t), continues=partial.continues)
                continue
            left = max_new - len(partial.ids)
            if left <= 0:
                partial.finish = "length"
                break
            payload = self.payload(prompt_ids + partial.ids, 1, left, False, seed, temperature=t)
            partial.extend((await self.generate(payload, session_id))[0])
        return partial
