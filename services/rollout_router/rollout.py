"""The rollout loop: prompts -> engines -> samples -> rewards -> Redis.

`run()`, an asyncio task owned by `RolloutController` (evaluation.py runs beside it),
produces batches b = 0, 1, 2, ... Before batch b it waits while the loop is paused, while no
engine is admitted, and until the engines' weight version is at least `b - max_staleness` (the
trainer trains batch b at version b, so nothing it receives is staler than that). A batch sends
one `/generate` per prompt with `n = n_samples_per_prompt`, all prompts at once (at most
`rollout_max_concurrency` requests in flight when set), and puts each group into the buffer as
soon as it is complete. Puts are serialized and wait, in the event loop, while the buffer holds
`max_groups` untrained groups: rollout never outruns the trainer by more than that. Batch b+1
starts once each group of batch b is in Redis or recorded as dropped.

The engines' version is `max(version:engines in Redis, lowest version any admitted engine
reported)`: the broker sets the Redis key once every engine has loaded a version; engines
report theirs in `/get_model_info` and in each response's `meta_info.weight_version`.

Stops: every request carries `--rollout-stop` strings and `--rollout-stop-token-ids` (plus the
tokenizer's EOS) with `no_stop_trim`, so a sample that ends on a stop keeps it: the matched
token is its last response token and the text ends where the matched stop ends (samples.py).

Dynamic sampling (DAPO): a group whose rewards are all equal carries no GRPO signal; it is
dropped (`all_rewards_equal`) and further rounds of prompts refill the batch, up to
`max_sampling_rounds`; groups finishing after the batch is full are dropped as `surplus`.
Every group that is not put is recorded with its reason (`engine_error`, `aborted`,
`reward_error`, ...); none is lost silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from proto import DropRecord, Sample, SampleGroup
from services.rollout_router.config import RolloutConfig, SamplingConfig
from services.rollout_router.environments import EnvError, EpisodeRunner
from services.rollout_router.limiter import Limiter
from services.rollout_router.rewards import Reward, RewardError
from services.rollout_router.samples import Partial, as_list, parse_version, sampling_seed
from services.rollout_router.tasks import Item, Task
from services.rollout_router.workers import EngineRequestError, NoWorkerError, WorkerPool
from services.sample_buffer import SampleBuffer

log = logging.getLogger("tandem.router.rollout")


def batch_items(items: list[Item], batch: int, size: int, seed: int, round_: int = 0) -> list[Item]:
    """The prompts of one round of one batch: without replacement when the set is large enough."""
    rng = random.Random(f"{seed}:{batch}:{round_}")
    return rng.sample(items, size) if size <= len(items) else rng.choices(items, k=size)


class GroupDroppedError(Exception):
    """A group will not be trained on; `reason` is its drop counter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class BatchState:
    """Groups put so far for one batch, against its target."""

    index: int
    target: int
    kept: int = 0
    samples: int = 0
    reward_sum: float = 0.0
    length_sum: int = 0
    min_version: int | None = None

    @property
    def full(self) -> bool:
        return self.kept >= self.target


class RolloutLoop:
    """Produces sample groups batch by batch, gated by the engines' weight version."""

    def __init__(
        self,
        config: RolloutConfig,
        sampling: SamplingConfig,
        pool: WorkerPool,
        buffer: SampleBuffer,
        task: Task,
        reward: Reward,
        stop_token_ids: list[int],
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.config, self.sampling = config, sampling
        self.pool, self.buffer, self.task, self.reward = pool, buffer, task, reward
        self.stop_token_ids = stop_token_ids
        self.episodes = episodes
        self.state = "idle"
        self.batch = 0
        self.in_flight = 0
        self.samples_per_s = 0.0
        self.groups_put = 0
        self.last_eval: dict[str, float] = {}
        self.last_eval_version = -1
        self.error = ""
        self.limiter = Limiter(config.rollout_max_concurrency)
        self._resume = asyncio.Event()
        self._resume.set()
        self._put_lock = asyncio.Lock()
        self._room = 0  # groups we may still put before reading the stream's depth again
        self.current: BatchState | None = None

    # --- versions and control ------------------------------------------------------------------

    def engines_version(self) -> int:
        return max(self.buffer.get_version("engines"), self.pool.min_version())

    async def wait_for_version(self, needed: int) -> None:
        while self.engines_version() < needed:
            self.state = "waiting_for_weights"
            await asyncio.sleep(self.config.version_poll_s)

    async def wait_for_workers(self) -> None:
        """With no admitted engine, every group would fail at once: wait instead of dropping."""
        while not self.pool.admitted():
            self.state = "waiting_for_workers"
            await asyncio.sleep(self.config.version_poll_s)

    def pause(self) -> None:
        """Finish the current batch, then wait for `resume()`."""
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    def apply(self, rollout: RolloutConfig, sampling: SamplingConfig) -> None:
        """Use validated new settings from the next request (and the next batch) on."""
        self.config, self.sampling = rollout, sampling
        self.limiter.set_limit(rollout.rollout_max_concurrency)

    # --- rollout -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Batches until cancelled. A Redis outage ends the current batch short: once Redis
        answers again, the groups it could not put are counted (`redis_unavailable`) and the
        next batch starts (re-running the batch would put its earlier groups twice)."""
        try:
            while True:
                if self.paused:
                    self.state = "paused"
                    await self._resume.wait()
                try:
                    await self.wait_for_workers()
                    await self.wait_for_version(self.batch - self.config.max_staleness)
                    await self.run_batch(self.batch)
                except RedisError as exc:
                    await self._wait_for_redis(exc)
                    if self.current is None or self.current.index != self.batch:
                        continue  # the batch had not started: run it now
                self.batch += 1
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("rollout loop failed")
            raise

    async def _wait_for_redis(self, exc: Exception) -> None:
        self.state, self.error = "waiting_for_redis", f"{type(exc).__name__}: {exc}"
        log.warning("Redis unavailable (%s); waiting for it", exc)
        while True:
            await asyncio.sleep(1.0)
            try:
                await asyncio.to_thread(self.buffer.redis.ping)
                break
            except RedisError:
                continue
        batch = self.current
        if batch is not None and not batch.full:
            await self._drop(
                f"b{batch.index}", "redis_unavailable", str(exc), batch.target - batch.kept
            )
        self._room, self.error = 0, ""

    async def run_batch(self, index: int) -> BatchState:
        """Rounds of prompts until `rollout_batch_size` groups are put (one round without
        dynamic sampling), then the batch's metrics."""
        self.state = "generating"
        cfg = self.config
        batch = self.current = BatchState(index, cfg.rollout_batch_size)
        start, next_prompt = time.monotonic(), 0
        for round_ in range(cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
            if batch.full:
                break
            size = (
                (cfg.over_sampling_batch_size or cfg.rollout_batch_size) if round_ else batch.target
            )
            items = batch_items(self.task.train, index, size, cfg.seed, round_)
            results = await asyncio.gather(
                *(self.run_group(batch, next_prompt + i, item) for i, item in enumerate(items)),
                return_exceptions=True,  # let every group finish before a failure propagates
            )
            next_prompt += size
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        if not batch.full:
            log.warning("batch %d ended with %d of %d groups", index, batch.kept, batch.target)
        await self._publish_batch(batch, max(time.monotonic() - start, 1e-9), next_prompt)
        return batch

    async def _publish_batch(self, batch: BatchState, elapsed: float, prompts: int) -> None:
        self.samples_per_s = batch.samples / elapsed
        if not batch.kept:
            return
        values = {
            "rollout/batch": float(batch.index),
            "rollout/reward_mean": batch.reward_sum / batch.samples,
            "rollout/samples_per_s": self.samples_per_s,
            "rollout/response_len_mean": batch.length_sum / batch.samples,
            "rollout/groups": float(batch.kept),
            "rollout/prompts_generated": float(prompts),
            "rollout/batch_time_s": elapsed,
            "rollout/engines_version": float(self.engines_version()),
        }
        step = batch.min_version if batch.min_version is not None else 0
        await asyncio.to_thread(self.buffer.publish_metrics, "router", step, values)

    def payload(self, input_ids: list[int], n: int, max_new: int, greedy: bool, seed: int) -> dict:
        """One /generate body. n > 1 is a batch of n copies of the prompt, copy k seeded with
        `sampling_seed(seed, k)`: n distinct samples, reproducible where the engine honours
        seeds (not SGLang's `n`, whose samples share one seed; see the README)."""
        s = self.sampling

        def params(copy_seed: int) -> dict:
            return {
                "max_new_tokens": max_new,
                "temperature": 0.0 if greedy else s.rollout_temperature,
                "top_p": s.rollout_top_p,
                "top_k": s.rollout_top_k,
                "n": 1,
                "stop_token_ids": self.stop_token_ids,
                "sampling_seed": copy_seed,
                "skip_special_tokens": True,
                # keep a matched stop string or stop token in the text (SGLang trims it by
                # default): the text the reward reads then matches the tokens trained on
                "no_stop_trim": True,
                **({"stop": s.rollout_stop} if s.rollout_stop else {}),
            }

        if n == 1:
            return {"input_ids": input_ids, "sampling_params": params(seed), "return_logprob": True}
        return {
            "input_ids": [list(input_ids) for _ in range(n)],
            "sampling_params": [params(sampling_seed(seed, k)) for k in range(n)],
            "return_logprob": True,
        }

    async def generate(
        self, payload: dict[str, Any], session_id: str | None = None
    ) -> list[dict[str, Any]]:
        """One /generate (retried across engines by the pool); notes the reported versions.
        `session_id` keeps an episode's turns on one engine under session affinity."""
        async with self.limiter:
            self.in_flight += 1
            try:
                data, worker = await self.pool.post_json("/generate", payload, session_id)
            finally:
                self.in_flight -= 1
        outs = as_list(data)
        for out in outs:
            v = parse_version(out.get("meta_info", {}).get("weight_version"))
            worker.weight_version = max(worker.weight_version, v)
        return outs

    async def run_group(self, batch: BatchState, index: int, item: Item) -> None:
        group_id = f"b{batch.index}-p{index}"
        committed = [False]  # set once the XADD is under way: from then on the group is put
        try:
            group = await self.make_group(batch.index, index, item, group_id)
            if self.config.dynamic_sampling and len({s.reward for s in group.samples}) == 1:
                raise GroupDroppedError(
                    "all_rewards_equal", f"every reward is {group.samples[0].reward}"
                )
            if batch.full:
                raise GroupDroppedError("surplus", "the batch was already full")
            batch.kept += 1  # reserve the slot before awaiting the put
            try:
                await self.put(group, committed)
            except RedisError:
                batch.kept -= 1
                raise
        except GroupDroppedError as exc:
            await self._drop(group_id, exc.reason, str(exc))
            return
        except asyncio.CancelledError:
            # Stopped mid-batch: the group will not be trained on; say so before unwinding
            # (synchronously: a cancelled task cannot reliably await).
            if not committed[0]:
                self.buffer.record_drop(
                    DropRecord(
                        source="router",
                        reason="cancelled",
                        count=1,
                        group_id=group_id,
                        detail="rollout stopped",
                    )
                )
            raise
        batch.samples += len(group.samples)
        batch.reward_sum += sum(s.reward for s in group.samples)
        batch.length_sum += sum(len(s.response_ids) for s in group.samples)
        v = group.weight_version
        batch.min_version = v if batch.min_version is None else min(batch.min_version, v)

    async def make_group(self, batch: int, index: int, item: Item, group_id: str) -> SampleGroup:
        """Generate (single turns or environment episodes) and reward one prompt's group."""
        seed = sampling_seed(self.config.seed, batch, index)
        try:
            if self.episodes is not None:
                samples = await self._episode_samples(item, group_id, seed)
            else:
                samples = await self._single_turn_samples(item, seed)
        except (EngineRequestError, NoWorkerError) as exc:
            raise GroupDroppedError("engine_error", str(exc)) from exc
        except RewardError as exc:
            raise GroupDroppedError("reward_error", str(exc)) from exc
        return SampleGroup(
            group_id=group_id,
            prompt=item.prompt,
            label=item.label,
            samples=samples,
            weight_version=min(s.weight_version for s in samples),
            created_at=time.time(),
        )

    async def _single_turn_samples(self, item: Item, seed: int) -> list[Sample]:
        n, max_new = self.config.n_samples_per_prompt, self.sampling.rollout_max_response_len
        prompt_ids = list(item.input_ids)
        outs = await self.generate(self.payload(prompt_ids, n, max_new, False, seed))
        if len(outs) != n:
            raise EngineRequestError(f"engine returned {len(outs)} samples, asked for {n}")
        partials = [Partial.of(out) for out in outs]
        aborted = [k for k, p in enumerate(partials) if p.finish == "abort"]
        if aborted:  # only these need more requests; tasks for the rest would be pure overhead
            redone = await asyncio.gather(
                *(self.complete(prompt_ids, partials[k], seed + k) for k in aborted)
            )
            for k, partial in zip(aborted, redone, strict=True):
                partials[k] = partial
        if any(p.finish == "abort" for p in partials):
            raise GroupDroppedError(
                "aborted", f"still aborted after {self.config.max_continues} tries"
            )
        rewards = await self.reward.score_all(
            item.prompt, [(p.text, p.finish) for p in partials], item.label
        )
        return [p.to_sample(prompt_ids, r) for p, r in zip(partials, rewards, strict=True)]

    async def _episode_samples(self, item: Item, group_id: str, seed: int) -> list[Sample]:
        """n episodes; a failed one is recorded as a drop and the others are kept."""
        assert self.episodes is not None
        max_new = self.sampling.rollout_max_response_len

        def turn_of(episode_id: str) -> Callable[[list[int], int], Awaitable[Partial]]:
            async def turn(context: list[int], turn_seed: int) -> Partial:
                payload = self.payload(context, 1, max_new, False, turn_seed)
                out = await self.generate(payload, episode_id)
                partial = await self.complete(context, Partial.of(out[0]), turn_seed, episode_id)
                if partial.finish == "abort":
                    raise EnvError("aborted", "a model turn stayed aborted")
                return partial

            return turn

        n = self.config.n_samples_per_prompt
        results = await asyncio.gather(
            *(
                self.episodes.run(item, f"{group_id}-e{k}", seed + k, turn_of(f"{group_id}-e{k}"))
                for k in range(n)
            ),
            return_exceptions=True,
        )
        samples = []
        for k, result in enumerate(results):
            if isinstance(result, EnvError):
                await self._drop(f"{group_id}-e{k}", result.reason, str(result))
            elif isinstance(result, BaseException):
                raise result
            else:
                samples.append(result)
        if not samples:
            raise GroupDroppedError("env_all_failed", f"all {n} episodes failed")
        return samples

    async def complete(
        self, prompt_ids: list[int], partial: Partial, seed: int, session_id: str | None = None
    ) -> Partial:
        """Continue (partial rollout) or restart an aborted sample, at most `max_continues`
        times. A continuation sends prompt + the tokens so far and asks for the rest."""
        max_new = self.sampling.rollout_max_response_len
        while partial.finish == "abort" and partial.continues < self.config.max_continues:
            partial.continues += 1
            seed = sampling_seed(seed, partial.continues)
            if not self.config.partial_rollout:  # start over; the aborted tokens are discarded
                payload = self.payload(prompt_ids, 1, max_new, False, seed)
                out = await self.generate(payload, session_id)
                partial = dataclasses.replace(Partial.of(out[0]), continues=partial.continues)
                continue
            left = max_new - len(partial.ids)
            if left <= 0:
                partial.finish = "length"
                break
            payload = self.payload(prompt_ids + partial.ids, 1, left, False, seed)
            partial.extend((await self.generate(payload, session_id))[0])
        return partial

    async def put(self, group: SampleGroup, committed: list[bool]) -> None:
        """Serialized put that waits in the event loop (not a thread) while the buffer is full,
        so that cancellation at shutdown is immediate. Once the XADD starts it is shielded
        from cancellation and `committed[0]` is set.

        The stream's depth only falls between our reads (the trainer acks), so after reading
        depth d we may put max_groups - d groups before reading it again."""
        async with self._put_lock:
            while self._room <= 0:
                depth = await asyncio.to_thread(self.buffer.depth)
                self._room = self.buffer.config.max_groups - depth
                if self._room <= 0:
                    self.state = "waiting_for_buffer"
                    await asyncio.sleep(0.05)
            committed[0] = True
            self._room -= 1
            self.groups_put += 1
            await asyncio.shield(asyncio.to_thread(self.buffer.put_group, group))
            self.state = "generating"

    async def _drop(self, group_id: str, reason: str, detail: str, count: int = 1) -> None:
        log.warning("dropping %d group(s) %s: %s (%s)", count, group_id, reason, detail[:300])
        record = DropRecord(
            source="router", reason=reason, count=count, group_id=group_id, detail=detail[:500]
        )
        await asyncio.to_thread(self.buffer.record_drop, record)

    def status(self) -> dict[str, Any]:
        """The loop's state; the Redis-backed fields are None while Redis is unavailable."""
        redis_fields: dict[str, Any] = dict.fromkeys(
            ("engines_version", "trainer_version", "buffer_depth", "drops")
        )
        with contextlib.suppress(RedisError):
            redis_fields = {
                "engines_version": self.engines_version(),
                "trainer_version": self.buffer.get_version("trainer"),
                "buffer_depth": self.buffer.depth(),
                "drops": self.buffer.drop_counts(),
            }
        return {
            "state": self.state,
            "paused": self.paused,
            "error": self.error,
            "batch": self.batch,
            "in_flight": self.in_flight,
            "samples_per_s": self.samples_per_s,
            "groups_put": self.groups_put,
            "last_eval_version": self.last_eval_version,
            "last_eval": self.last_eval,
            **redis_fields,
        }
