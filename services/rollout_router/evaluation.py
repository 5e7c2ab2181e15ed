"""Held-out evaluation: every held-out prompt once, greedily, at each new weight version.

`run_evaluations(loop)` runs beside the rollout loop (and also when rollouts are off, since
agents may be the only producers). It polls the engines' version and evaluates at start and
whenever the version reaches a new multiple of `eval_interval`, publishing `eval/accuracy`
(exact match: the task's judge, else reward >= 1) and `eval/reward_mean` at that version.
A prompt whose generation or reward fails counts in `eval/failed`, never ends the task.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from services.rollout_router.rewards import RewardError
from services.rollout_router.rollout import RolloutLoop
from services.rollout_router.samples import Partial
from services.rollout_router.workers import EngineRequestError, NoWorkerError

log = logging.getLogger("tandem.router.eval")


async def run_evaluations(loop: RolloutLoop) -> None:
    """Evaluate at start, then at each new multiple of `eval_interval`, until cancelled."""
    interval = loop.config.eval_interval
    if interval <= 0 or not loop.task.heldout:
        return
    last_bucket: int | None = None
    while True:
        try:
            version = max(await loop.engines_version(), 0)
        except RedisError:
            await asyncio.sleep(1.0)
            continue
        if last_bucket is None or version // interval > last_bucket:
            last_bucket = version // interval
            try:
                await evaluate(loop, version)
            except (EngineRequestError, NoWorkerError, RewardError, RedisError) as exc:
                log.warning("evaluation at version %d failed: %s", version, exc)
        await asyncio.sleep(loop.config.version_poll_s * 4)


async def evaluate(loop: RolloutLoop, version: int) -> dict[str, float]:
    """Every held-out prompt once, greedily; publishes eval metrics at `version`."""
    items, max_new = loop.task.heldout, loop.sampling.rollout_max_response_len
    outs = await asyncio.gather(
        *(loop.generate(loop.payload(list(it.input_ids), 1, max_new, True, 0)) for it in items),
        return_exceptions=True,
    )
    rewards, exact, failed = [], [], 0
    for item, out in zip(items, outs, strict=True):
        if isinstance(out, BaseException):
            failed += 1
            continue
        partial = Partial.of(out[0])
        try:
            reward = await loop.reward.score(item.prompt, partial.text, item.label, partial.finish)
        except RewardError:  # logged once and counted by the reward itself
            failed += 1
            continue
        stopped = partial.finish == "stop"
        rewards.append(reward)
        judge = loop.task.exact
        exact.append(judge(partial.text, item.label, stopped) if judge else reward >= 1.0)
    values = {
        "eval/accuracy": sum(exact) / len(exact) if exact else 0.0,
        "eval/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "eval/num_prompts": float(len(exact)),
        "eval/failed": float(failed),
    }
    await loop.buffer.publish_metrics("router", version, values)
    loop.last_eval, loop.last_eval_version = values, version
    log.info("eval at version %d: %s", version, values)
    return values
