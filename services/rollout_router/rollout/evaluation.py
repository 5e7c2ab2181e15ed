"""Held-out evaluation: every held-out prompt once, greedily, at each new weight version.

The held-out prompts are the running task's (`describe` says which): the toy task's held-out
digit pairs, a dataset's `--eval-prompt-data` or the fraction of `--prompt-data` held out of
training; an environment run plays one greedy episode per held-out task (success: episode
reward >= 1).

`run_evaluations(loop)` runs beside the rollout loop (and also when rollouts are off, since
agents may be the only producers). It polls the engines' version and evaluates at start and
whenever the version reaches a new multiple of `eval_interval` (once an engine is in the
rotation: with none, as while the only one restarts, every prompt would fail), publishing
`eval/accuracy` (exact match: the task's judge, else reward >= 1) and `eval/reward_mean` at
that version.
A prompt whose generation or reward fails counts in `eval/failed`, never ends the task, and
counts as not solved in `eval/accuracy` (`eval/reward_mean` is over the prompts scored): an
evaluation cut short (an environment or the engines lost half way) gives a lower bound, never
the accuracy of the few prompts that happened to finish, which `tandem up --stop-accuracy`
would take for success. When every one fails, both are left out (none was measured).
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from services.rollout_router.balancer.worker import EngineRequestError, NoWorkerError
from services.rollout_router.rollout.environments import EnvError
from services.rollout_router.rollout.loop import RolloutLoop
from services.rollout_router.rollout.rewards import RewardError
from services.rollout_router.rollout.tasks import Item
from services.rollout_router.samples import Partial

log = logging.getLogger("tandem.router.eval")
EVAL_FAILURES = (EnvError, EngineRequestError, NoWorkerError)


async def run_evaluations(loop: RolloutLoop) -> None:
    """Evaluate at start, then at each new multiple of `eval_interval`, until cancelled. In a
    run that has trained (a resume, a router restarted), start at the trainer's version: the
    engines of a resume start on the model's weights, evaluated already."""
    interval = loop.config.eval_interval
    if interval <= 0 or not loop.task.heldout:
        return
    last_bucket: int | None = None
    while True:
        try:
            if last_bucket is None and (trained := await loop.buffer.get_version("trainer")) > 0:
                last_bucket = (trained - 1) // interval
            version = max(await loop.engines_version(), 0)
        except RedisError:
            await asyncio.sleep(1.0)
            continue
        due = last_bucket is None or version // interval > last_bucket
        if due and loop.pool.admitted():  # (none: every prompt would fail; wait for one)
            last_bucket = version // interval
            try:
                await evaluate(loop, version)
            except (EngineRequestError, NoWorkerError, RewardError, RedisError) as exc:
                log.warning("evaluation at version %d failed: %s", version, exc)
        await asyncio.sleep(loop.config.version_poll_s * 4)


def describe(loop: RolloutLoop) -> str:
    """What the held-out accuracy scores, for the operator."""
    task = loop.task
    if loop.episodes is not None:
        return (
            f"environment {loop.episodes.client.url}: one greedy episode per held-out task of "
            f"{task.name} ({task.heldout_source}); success = episode reward >= 1"
        )
    judge = "exact answer" if task.exact else "reward >= 1"
    return f"{task.name}: {task.heldout_source}, greedy, {judge}"


async def evaluate(loop: RolloutLoop, version: int) -> dict[str, float]:
    """Every held-out prompt once, greedily (an environment run: one greedy episode each);
    publishes eval metrics at `version`."""
    items = loop.task.heldout
    if loop.episodes is not None:
        await _evaluate_episodes(loop, version)
        return loop.last_eval
    max_new = loop.sampling.rollout_max_response_len
    outs = await asyncio.gather(
        *(
            loop.gen.generate(loop.gen.payload(list(it.input_ids), 1, max_new, True, 0))
            for it in items
        ),
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
    await _publish(loop, version, rewards, exact, failed)
    return loop.last_eval


async def _evaluate_episodes(loop: RolloutLoop, version: int) -> None:
    """One greedy episode per held-out task, each with a fixed seed (the same at every
    version); an episode that fails counts in `eval/failed`."""
    assert loop.episodes is not None
    episodes = loop.episodes

    async def one(k: int, item: Item) -> float:
        episode_id = f"eval-v{version}-{k}"
        turn = loop.gen.episode_turn(episode_id, greedy=True)
        return (await episodes.run(item, episode_id, EVAL_SEED + k, turn)).reward

    outs = await asyncio.gather(
        *(one(k, item) for k, item in enumerate(loop.task.heldout)), return_exceptions=True
    )
    for out in outs:
        if isinstance(out, BaseException) and not isinstance(out, EVAL_FAILURES):
            raise out
    rewards = [out for out in outs if isinstance(out, float)]
    failed = len(outs) - len(rewards)
    await _publish(loop, version, rewards, [r >= 1.0 for r in rewards], failed)


EVAL_SEED = 1_000_000_000  # environment seeds of evaluation episodes, apart from rollouts'


async def _publish(
    loop: RolloutLoop, version: int, rewards: list[float], exact: list[bool], failed: int
) -> None:
    values = {"eval/num_prompts": float(len(exact)), "eval/failed": float(failed)}
    if exact:  # (none scored: no accuracy was measured, and none is reported)
        values["eval/accuracy"] = sum(exact) / (len(exact) + failed)
        values["eval/reward_mean"] = sum(rewards) / len(rewards)
    await loop.buffer.publish_metrics("router", version, values)
    loop.last_eval, loop.last_eval_version = values, version
    if exact:
        log.info("eval at version %d: %s", version, values)
    else:
        log.warning(
            f"eval at version {version}: every one of the {failed} held-out prompts failed (the "
            "reasons are in this log): no accuracy measured"
        )
