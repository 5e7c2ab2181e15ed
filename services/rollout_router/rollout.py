"""The rollout loop: prompts -> engines -> samples -> rewards -> Redis.

Two asyncio tasks, both started by the app's lifespan:
- `run()` produces batches b = 0, 1, 2, ... Before batch b it waits until the engines' weight
  version is at least `b - max_staleness` (the trainer trains batch b at version b, so nothing
  it receives is staler than that), and while the loop is paused. A batch sends one
  `/generate` per prompt with `n = n_samples_per_prompt`, all prompts at once, and puts each
  group into the buffer as soon as it is complete. Puts are serialized and wait (asynchronously)
  while the buffer holds `max_groups` untrained groups, so rollout never outruns the trainer by
  more than the buffer. Batch b+1 starts after every group of batch b is in Redis or dropped.
- `run_evaluations()` polls the engines' version and, at start and whenever the version reaches
  a new multiple of `eval_interval`, runs every held-out prompt greedily and publishes
  `eval/accuracy` and `eval/reward_mean` at that version.

The engines' version is `max(version:engines in Redis, lowest version any admitted engine
reported)`: the broker sets the Redis key once every engine has loaded a version, and engines
report theirs in `/get_model_info` and in each response's `meta_info.weight_version`.
A group that fails on every engine is recorded as a drop (`reason="engine_error"`), never lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from typing import Any

from proto import DropRecord, Sample, SampleGroup
from services.rollout_router.config import RolloutConfig
from services.rollout_router.tasks import Item, Task
from services.rollout_router.workers import (
    EngineRequestError,
    NoWorkerError,
    WorkerPool,
    parse_version,
)
from services.sample_buffer import SampleBuffer

log = logging.getLogger("tandem.router.rollout")


def sampling_seed(seed: int, batch: int, index: int) -> int:
    """A stable 31-bit seed per (run seed, batch, prompt index)."""
    digest = hashlib.blake2b(f"{seed}/{batch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def batch_items(items: list[Item], batch: int, size: int, seed: int) -> list[Item]:
    """The prompts of batch `batch`: without replacement when the set is large enough."""
    rng = random.Random(f"{seed}:{batch}")
    return rng.sample(items, size) if size <= len(items) else rng.choices(items, k=size)


def as_list(data: Any) -> list[dict[str, Any]]:
    """SGLang answers a single object for n=1 and a list for n>1."""
    return data if isinstance(data, list) else [data]


def build_sample(item: Item, out: dict[str, Any], task: Task) -> Sample:
    """One `Sample` from one engine output, with exact token ids and its reward."""
    meta = out.get("meta_info", {})
    token_logprobs = meta.get("output_token_logprobs") or []
    ids = [int(t[1]) for t in token_logprobs]
    logprobs = [float(t[0]) for t in token_logprobs]
    finish = (meta.get("finish_reason") or {}).get("type", "length")
    version = parse_version(meta.get("weight_version"))
    text = out.get("text", "")
    return Sample(
        prompt_ids=list(item.input_ids),
        response_ids=ids,
        response_logprobs=logprobs,
        loss_mask=[1] * len(ids),
        reward=task.reward(text, item.label, finish == "stop"),
        weight_version=version,
        token_versions=[version] * len(ids),
        finish_reason=finish,
        response_text=text,
    )


class RolloutLoop:
    """Produces sample groups batch by batch, gated by the engines' weight version."""

    def __init__(
        self,
        config: RolloutConfig,
        pool: WorkerPool,
        buffer: SampleBuffer,
        task: Task,
        stop_token_ids: list[int],
    ) -> None:
        self.config = config
        self.pool = pool
        self.buffer = buffer
        self.task = task
        self.stop_token_ids = stop_token_ids
        self.state = "idle"
        self.batch = 0
        self.in_flight = 0
        self.samples_per_s = 0.0
        self.groups_put = 0
        self.last_eval: dict[str, float] = {}
        self.last_eval_version = -1
        self.error = ""
        self._resume = asyncio.Event()
        self._resume.set()
        self._put_lock = asyncio.Lock()

    # --- versions ----------------------------------------------------------------------------

    def engines_version(self) -> int:
        return max(self.buffer.get_version("engines"), self.pool.min_version())

    async def wait_for_version(self, needed: int) -> None:
        while self.engines_version() < needed:
            self.state = "waiting_for_weights"
            await asyncio.sleep(self.config.version_poll_s)

    # --- control -------------------------------------------------------------------------------

    def pause(self) -> None:
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    # --- rollout -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Batches until cancelled."""
        try:
            while True:
                if self.paused:
                    self.state = "paused"
                    await self._resume.wait()
                await self.wait_for_version(self.batch - self.config.max_staleness)
                await self.run_batch(self.batch)
                self.batch += 1
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("rollout loop failed")
            raise

    async def run_batch(self, batch: int) -> list[SampleGroup]:
        self.state = "generating"
        cfg = self.config
        items = batch_items(self.task.train, batch, cfg.rollout_batch_size, cfg.seed)
        start = time.monotonic()
        results = await asyncio.gather(
            *(self.run_group(batch, i, item) for i, item in enumerate(items))
        )
        elapsed = max(time.monotonic() - start, 1e-9)
        groups = [g for g in results if g is not None]
        samples = [s for g in groups for s in g.samples]
        self.samples_per_s = len(samples) / elapsed
        if groups:
            version_used = min(g.weight_version for g in groups)
            values = {
                "rollout/batch": float(batch),
                "rollout/reward_mean": sum(s.reward for s in samples) / len(samples),
                "rollout/samples_per_s": self.samples_per_s,
                "rollout/response_len_mean": sum(len(s.response_ids) for s in samples)
                / len(samples),
                "rollout/groups": float(len(groups)),
                "rollout/groups_dropped": float(len(items) - len(groups)),
                "rollout/batch_time_s": elapsed,
                "rollout/engines_version": float(self.engines_version()),
            }
            await asyncio.to_thread(self.buffer.publish_metrics, "router", version_used, values)
        return groups

    def _payload(self, item: Item, n: int, temperature: float, seed: int) -> dict[str, Any]:
        cfg = self.config
        return {
            "input_ids": list(item.input_ids),
            "sampling_params": {
                "max_new_tokens": cfg.rollout_max_response_len,
                "temperature": temperature,
                "top_p": cfg.rollout_top_p,
                "top_k": cfg.rollout_top_k,
                "n": n,
                "stop_token_ids": self.stop_token_ids,
                "sampling_seed": seed,
                "no_stop_trim": False,
                "skip_special_tokens": True,
            },
            "return_logprob": True,
        }

    async def generate(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """One /generate (retried across engines by the pool); notes the reported versions."""
        self.in_flight += 1
        try:
            data, worker = await self.pool.post_json("/generate", payload)
        finally:
            self.in_flight -= 1
        outs = as_list(data)
        for out in outs:
            v = parse_version(out.get("meta_info", {}).get("weight_version"))
            worker.weight_version = max(worker.weight_version, v)
        return outs

    async def run_group(self, batch: int, index: int, item: Item) -> SampleGroup | None:
        cfg = self.config
        group_id = f"b{batch}-p{index}"
        seed = sampling_seed(cfg.seed, batch, index)
        payload = self._payload(item, cfg.n_samples_per_prompt, cfg.rollout_temperature, seed)
        try:
            outs = await self.generate(payload)
            if len(outs) != cfg.n_samples_per_prompt:
                raise EngineRequestError(
                    f"engine returned {len(outs)} samples, asked for {cfg.n_samples_per_prompt}"
                )
        except (EngineRequestError, NoWorkerError, ValueError) as exc:
            await self._drop(group_id, "engine_error", str(exc))
            return None
        samples = [build_sample(item, out, self.task) for out in outs]
        group = SampleGroup(
            group_id=group_id,
            prompt=item.prompt,
            label=item.label,
            samples=samples,
            weight_version=min(s.weight_version for s in samples),
            created_at=time.time(),
        )
        await self.put(group)
        return group

    async def put(self, group: SampleGroup) -> None:
        """Serialized put that waits in the event loop (not a thread) while the buffer is full,
        so cancellation at shutdown is immediate."""
        async with self._put_lock:
            while await asyncio.to_thread(self.buffer.depth) >= self.buffer.config.max_groups:
                self.state = "waiting_for_buffer"
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self.buffer.put_group, group)
            self.groups_put += 1

    async def _drop(self, group_id: str, reason: str, detail: str) -> None:
        log.warning("dropping group %s: %s (%s)", group_id, reason, detail)
        record = DropRecord(
            source="router", reason=reason, count=1, group_id=group_id, detail=detail[:500]
        )
        await asyncio.to_thread(self.buffer.record_drop, record)

    # --- evaluation ----------------------------------------------------------------------------

    async def run_evaluations(self) -> None:
        """Evaluate at start, then at each new multiple of `eval_interval`, until cancelled."""
        interval = self.config.eval_interval
        if interval <= 0:
            return
        last_bucket: int | None = None
        while True:
            version = max(self.engines_version(), 0)
            if last_bucket is None or version // interval > last_bucket:
                last_bucket = version // interval
                await self.evaluate(version)
            await asyncio.sleep(self.config.version_poll_s * 4)

    async def evaluate(self, version: int) -> dict[str, float]:
        """Every held-out prompt once, greedily; publishes eval metrics at `version`."""
        items = self.task.heldout
        outs = await asyncio.gather(
            *(self.generate(self._payload(it, 1, 0.0, 0)) for it in items), return_exceptions=True
        )
        rewards, exact, failed = [], [], 0
        for item, out in zip(items, outs, strict=True):
            if isinstance(out, BaseException):
                failed += 1
                continue
            text = out[0].get("text", "")
            stopped = (out[0].get("meta_info", {}).get("finish_reason") or {}).get("type") == "stop"
            rewards.append(self.task.reward(text, item.label, stopped))
            exact.append(self.task.exact(text, item.label, stopped))
        values = {
            "eval/accuracy": sum(exact) / len(exact) if exact else 0.0,
            "eval/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "eval/num_prompts": float(len(exact)),
            "eval/failed": float(failed),
        }
        await asyncio.to_thread(self.buffer.publish_metrics, "router", version, values)
        self.last_eval, self.last_eval_version = values, version
        log.info("eval at version %d: %s", version, values)
        return values

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "error": self.error,
            "batch": self.batch,
            "engines_version": self.engines_version(),
            "trainer_version": self.buffer.get_version("trainer"),
            "in_flight": self.in_flight,
            "samples_per_s": self.samples_per_s,
            "groups_put": self.groups_put,
            "buffer_depth": self.buffer.depth(),
            "drops": self.buffer.drop_counts(),
            "last_eval_version": self.last_eval_version,
            "last_eval": self.last_eval,
        }
