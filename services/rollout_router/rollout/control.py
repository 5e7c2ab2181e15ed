"""Rollout control: start, pause, resume, stop, and validated configuration changes.

Knows: the rollout loop's asyncio tasks (groups, evaluations, status reports) and how to
rebuild the prompt set when the dataset changes. Pause stops new groups (those in flight finish
and are put); stop cancels the tasks at once, and every group still in flight is recorded as a
drop with reason `cancelled`. Start after stop goes on with the next prompt of the cursor.
A pause, resume, stop or configuration change asked for is published as a `control/*` metrics
record (`mark`), which the dashboard marks on its trainer curves.

The status reporter writes the loop's `ServiceStatus` to Redis, through the router's run
membership (`Membership.report`), every `STATUS_INTERVAL_S` and on each state change (it waits
for whichever comes first); a rollout or evaluation task that ended with an exception makes it
`failed` with the error, and `GET /health` answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from pydantic import BaseModel
from redis.exceptions import RedisError

from proto.contract import SampleLimits
from services.common.long_wait import LongWait
from services.rollout_router.balancer.engine_context import ContextGate
from services.rollout_router.config import (
    DataConfig,
    RolloutPatch,
    SamplingConfig,
    patches_in_force,
    patches_key,
    reward_problem,
)
from services.rollout_router.lease import LeaseError, RouterLease
from services.rollout_router.rollout.evaluation import run_evaluations
from services.rollout_router.rollout.loop import RolloutLoop
from services.rollout_router.rollout.report import service_status
from services.rollout_router.rollout.report import status as loop_status
from services.sample_buffer.aio import io

log = logging.getLogger("tandem.router.control")

STATUS_INTERVAL_S = 2.0
STATUS_TTL_S = 30.0
MARK_TIMEOUT_S = 2.0  # a control event's metrics record (the dashboard's mark), at most


def greedy_note(sampling: SamplingConfig, n: int) -> str:
    """What greedy rollouts (temperature 0 or top_k 1) of `n` samples a prompt do to learning
    ("" when they are not greedy, or n is 1)."""
    if n < 2 or (sampling.rollout_temperature != 0 and sampling.rollout_top_k != 1):
        return ""
    return (
        f"--rollout-temperature {sampling.rollout_temperature} --rollout-top-k "
        f"{sampling.rollout_top_k} samples greedily: the {n} samples of a prompt are one "
        "response; with a group-relative advantage (GRPO, the trainer's default) each is 0 and "
        "nothing is learned"
    )


def filter_problem(sampling: SamplingConfig) -> str:
    """Why rollouts of these settings could not be trained as drawn ("" when they can): the
    trainer scores each sample under the model's whole distribution at the sample's
    temperature (`Sample.temperature`), with no top_p/top_k filter."""
    for flag, value, whole in (
        ("--rollout-top-p", sampling.rollout_top_p, 1.0),
        ("--rollout-top-k", sampling.rollout_top_k, -1),
    ):
        if value != whole:
            return (
                f"{flag} {value}: rollouts are trained on, and the trainer scores their tokens "
                f"under the model's whole distribution (at the rollout temperature, with no "
                f"{flag[10:].replace('-', '_')} filter), so its log-probs would not be the "
                f"engines' and its off-policy correction would be wrong; leave {flag} at {whole}"
            )
    return ""


class ConfigPatchError(ValueError):
    """A PATCH names an unknown or frozen field, has a wrong type, or fails validation."""


class PatchRecordError(RuntimeError):
    """A valid PATCH the run's Redis did not record in MARK_TIMEOUT_S: not applied either."""


def patched(section: BaseModel, changes: dict[str, Any]) -> Any:
    """A copy of `section` with the `changes` that are its fields, checked again as a whole."""
    mine = {k: v for k, v in changes.items() if k in type(section).model_fields}
    return type(section).model_validate({**section.model_dump(), **mine}) if mine else section


def fit_problem(longest: int | None, length: int, context: int, limits: SampleLimits | None) -> str:
    """Why samples of prompts up to `longest` tokens (None: an environment's, unknown) and
    responses up to `length`, within the model's `context` positions (0: unknown), would not
    all fit the trainer's `limits` (None: no trainer has stated them); "" when they do."""
    if limits is None:
        return ""
    longer = "the longer ones would be dead-lettered as too_long, never trained"
    if length > limits.max_response_len:
        return (
            f"rollout_max_response_len {length}: the trainer takes responses of at most "
            f"{limits.max_response_len} tokens (its --max-response-len): {longer}; lower it, or "
            "restart the trainer with a higher --max-response-len"
        )
    reach = 0 if longest is None else longest + length
    if context:  # the router cuts each request's max_new_tokens at the context
        reach = min(reach, max(context, (longest or 0) + 1))
    if reach <= limits.max_tokens:
        return ""
    room = limits.max_tokens - (longest or 0)
    lower = f"lower rollout_max_response_len to {room}, or " if room > 0 else ""
    return (
        f"samples may reach {reach} tokens (the longest prompt, {longest}, and responses up to "
        f"{length}) and the trainer takes at most {limits.max_tokens} in all (the model's "
        f"context or its --max-tokens-per-gpu): {longer}; {lower}restart the trainer with "
        f"--max-tokens-per-gpu {reach - 1}"
    )


class RolloutController:
    """Owns the rollout loop's tasks; the control routes call one method each."""

    def __init__(
        self,
        loop: RolloutLoop,
        data: DataConfig,
        tokenizer: Any,
        build_task: Any,
        scored: bool = True,
    ):
        self.loop = loop
        self.data = data
        self.scored = scored  # a reward was chosen: a dataset may be patched in (reward_problem)
        self.tokenizer = tokenizer
        self.build_task = build_task  # (data config, tokenizer) -> Task
        self.task: asyncio.Task | None = None
        self.eval_task: asyncio.Task | None = None
        self.status_task: asyncio.Task | None = None
        self.lease_task: asyncio.Task | None = None
        self.long_wait = LongWait(log.warning, quiet=("rollouts off",))  # (--no-rollout)
        self.context_gate: ContextGate | None = None  # the engines' contexts (app.py sets it)
        self.configured = self.config()  # this start's settings, before the run's PATCHes

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start_tasks(self, lease: RouterLease) -> None:
        """Evaluations, status reports (through `lease`'s run membership) and the watch on
        `lease` run whether or not rollouts do (agents may be the only producers); once another
        router holds the lease, rollouts stop and `failure` says so."""
        self.eval_task = asyncio.create_task(run_evaluations(self.loop), name="eval")
        self.status_task = asyncio.create_task(self.report_status(lease), name="status")
        self.lease_task = asyncio.create_task(self._keep(lease), name="lease")

    async def _keep(self, lease: RouterLease) -> None:
        try:
            await lease.keep()
        except LeaseError:
            await self.stop()
            raise

    def failure(self) -> str:
        """The error that ended the rollout, evaluation or lease task; empty while all live."""
        for task in (self.task, self.eval_task, self.lease_task):
            if task is not None and task.done() and not task.cancelled() and task.exception():
                exc = task.exception()
                return f"{task.get_name()} task failed: {type(exc).__name__}: {exc}"
        return ""

    async def report_status(self, lease: RouterLease) -> None:
        """Write the status record every STATUS_INTERVAL_S and on each state change, through
        the run membership (`Membership.report`, in a thread)."""
        buffer = self.loop.buffer
        while True:
            with contextlib.suppress(TimeoutError):  # not wait_for: see RolloutLoop.run
                async with asyncio.timeout(STATUS_INTERVAL_S):
                    await self.loop.changed.wait()
            self.loop.changed.clear()  # (here: a change while this record is made makes another)
            look = self.loop.snapshot
            status = await service_status(look, buffer, self.loop.pool, self.failure())
            self.long_wait.check(status.state, status.waiting_for, status.since)
            try:
                await asyncio.to_thread(lease.member.report, status, STATUS_TTL_S)
            except RedisError as exc:  # the rollout loop reports the outage; retried next time
                log.debug("status not written: %s", exc)

    async def status(self) -> dict[str, Any]:
        """`GET /rollout/status`'s loop fields (`report.status`), `failed` once a task died."""
        said = await loop_status(self.loop.snapshot(), self.loop.buffer, self.loop.pool)
        if failure := self.failure():
            said.update(state="failed", error=failure)
        return {**said, "running": self.running}

    def start(self) -> None:
        if self.running:
            return
        self.loop.resume()
        self.task = asyncio.create_task(self.loop.run(), name="rollout")

    async def stop(self, waiting_for: str = "", mark: bool = False) -> None:
        """Stop the loop; `waiting_for` its status says (what starts it again); `mark`: a
        stop asked for, marked on the dashboard's curves (not the router's own at its end)."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if mark:
            await self.mark("stop")
        self.loop.set_state("stopped", waiting_for)
        # (the loop said "stopped" without it at its cancel: the same state is no change, and
        # Redis kept that status, which the watchdog read as a stall, until the next refresh)
        self.loop.changed.set()

    async def close(self) -> None:
        await self.stop()
        for task in (self.eval_task, self.status_task, self.lease_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(self.loop.observe.close)  # writes its last timeline spans
        self.loop.reward.close()

    async def pause(self) -> None:
        self.loop.pause()
        await self.mark("pause")

    async def resume(self) -> None:
        self.loop.resume()
        await self.mark("resume")

    async def mark(self, event: str) -> None:
        """Publish `control/EVENT` (1.0) as a router metrics record at the trainer's version,
        where the dashboard marks it on its trainer curves (pause, resume, stop, patch).
        Bounded: a Redis that does not answer in MARK_TIMEOUT_S loses the mark (logged)."""
        buffer = self.loop.buffer
        try:
            async with asyncio.timeout(MARK_TIMEOUT_S):
                version = max(await buffer.get_version("trainer"), 0)
                await buffer.publish_metrics("router", version, {f"control/{event}": 1.0})
        except (RedisError, TimeoutError) as exc:
            log.warning("the %s mark for the dashboard was not written: %r", event, exc)

    async def patch(self, body: BaseModel, record: bool = True) -> dict[str, Any]:
        """Apply a `RolloutPatch` (its type holds no run term and no unknown field) to the
        sampling, rollout and data settings; all or nothing. `record`: first append it to the
        run's PATCH record (`patches_key`), which a router started on the run re-applies."""
        changes = body.model_dump(exclude_none=True)
        live = self.loop.live
        rollout, sampling = patched(live.rollout, changes), patched(live.sampling, changes)
        data = patched(self.data, changes)
        if problem := filter_problem(sampling):
            raise ConfigPatchError(problem)
        task = self.loop.task
        if data != self.data:
            if problem := reward_problem(data.prompt_data, self.scored):
                raise ConfigPatchError(problem)
            try:
                task = await asyncio.to_thread(self.build_task, data, self.tokenizer)
            except ValueError as exc:
                raise ConfigPatchError(str(exc)) from exc
        if "rollout_max_response_len" in changes or task is not self.loop.task:
            longest = None if self.loop.episodes else task.longest_prompt
            limits = await self.loop.buffer.sample_limits()
            length = sampling.rollout_max_response_len
            if problem := fit_problem(longest, length, self.loop.gen.context_len, limits):
                raise ConfigPatchError(problem)
            if self.context_gate and (problem := self.context_gate.patch_problem(length)):
                raise ConfigPatchError(problem)
        if record:
            await self.record(changes)
        self.loop.task, self.data = task, data
        self.loop.apply(rollout, sampling)
        if note := greedy_note(sampling, live.run.n_samples_per_prompt):
            log.warning("PATCH /rollout/config: %s", note)
        return self.config()

    async def record(self, fields: dict[str, Any], by: str = "PATCH") -> None:
        """Append `fields` to the run's PATCH record (`patches_key`) and mark it on the
        dashboard: by a PATCH, by a start whose configuration overrides earlier PATCHes
        ("start"), by a start that re-applied them ("re-applied") or refused to ("refused: WHY",
        which `patches_in_force` passes by). PatchRecordError when Redis does not take it in
        MARK_TIMEOUT_S."""
        buffer = self.loop.buffer
        over = {key: self.configured.get(key) for key in fields}
        try:
            async with asyncio.timeout(MARK_TIMEOUT_S):
                version = max(await buffer.get_version("trainer"), 0)
                entry = {"time": time.time(), "version": version, "fields": fields, "over": over}
                entry |= {"by": by} if by != "PATCH" else {}
                await io(buffer.redis.rpush(patches_key(buffer.config.run_id), json.dumps(entry)))
        except (RedisError, TimeoutError) as exc:
            raise PatchRecordError(
                f"the run's Redis did not record it ({exc!r}): try again"
            ) from exc
        log.info("%s of /rollout/config at version %d, recorded: %s", by, version, fields)
        await self.mark("patch")

    async def replay(self) -> None:
        """At the router's start: re-apply the run's recorded PATCHes (`patches_in_force`), as
        a `tandem up --resume` or a router restarted on a running run must; a field this start
        gives another value wins over its PATCH, said and recorded. Each said in the log; a
        PATCH that is refused now (the trainer's limits changed) is said and not applied."""
        buffer = self.loop.buffer
        key = patches_key(buffer.config.run_id)
        records = [json.loads(raw) for raw in await io(buffer.redis.lrange(key, 0, -1))]
        apply, overridden = patches_in_force(records, self.configured)
        for field, (was, given) in overridden.items():
            ours, patched = json.dumps(given), json.dumps(was)
            log.warning(
                f"{field} = {ours} from this start's configuration wins over the run's PATCH to {patched}"
            )
        if overridden:
            await self.record({k: given for k, (_, given) in overridden.items()}, by="start")
        if not apply:
            return
        try:
            await self.patch(RolloutPatch(**apply), record=False)
        except ValueError as exc:  # (ConfigPatchError, or a recorded value the body refuses)
            log.warning("the run's PATCHes %s are refused now, not re-applied: %s", apply, exc)
            await self.record(apply, by=f"refused: {exc}")  # (said by tandem up too)
            return
        log.warning("re-applied the run's PATCHes of /rollout/config: %s", json.dumps(apply))
        await self.record(apply, by="re-applied")

    def config(self) -> dict[str, Any]:
        return {**self.loop.live.as_dict(), **self.data.model_dump()}
