"""The rollout loop: prompts -> engines -> samples -> rewards -> Redis, as a stream of groups.

`run()`, an asyncio task owned by `RolloutController` (evaluation.py runs beside it), starts
one task per group and keeps groups in flight up to what the demand gate allows (progress.py):
a group may start only while the rollout it would land in is within `max_staleness` versions of
the engines, counting groups put and not yet consumed by the trainer plus those in flight. The
loop waits while paused, while no engine is admitted, while the gate is closed (for the
trainer to consume groups, or for the engines' version to rise: both read from Redis every
`version_poll_s`), and after groups keep failing for a dependency (backoff, progress.py). It is
unblocked by a group ending (put or dropped: a drop reopens the gate, so a replacement starts),
by the trainer's counters and the engines' version moving, and by `resume()`. At most
`rollout_max_concurrency` groups (else `rollout_batch_size`) are in flight.

Each group task puts its group as soon as it is complete, in turn with agent sessions, waiting
while the backlog is at `--max-buffer-depth` (backpressure.py); no group starts while the
backlog and the groups in flight fill that bound. `rollout/*` metrics: every batch of groups put.

Prompts come from a cursor in Redis (`counters.prompts_drawn`): draw p is prompt p % len(train)
of a permutation of the train set seeded by (`seed`, epoch p // len(train)); its group id is
`p{p}` and its sampling seed derives from (seed, p), so a restarted router neither repeats nor
skips a prompt: what a killed one left in flight is drawn again first (`sample_buffer/ledger.py`).

The engines' version is `max(version:engines in Redis, lowest version any admitted engine
reported)`: the broker sets the Redis key once every engine has loaded a version; engines
report theirs in `/get_model_info` and in each response's `meta_info.weight_version`.

Stops: every request carries `--rollout-stop` strings and `--rollout-stop-token-ids` (plus the
tokenizer's EOS) with `no_stop_trim`, so a sample that ends on a stop keeps it: the matched
token is its last response token and the text ends where the matched stop ends (samples.py).

Dynamic sampling (DAPO): a group whose rewards are all equal carries no GRPO signal; it is
dropped (`all_rewards_equal`) and the gate starts another. A sample whose reward fails is
dropped alone (`reward_error`, `reward_nonfinite`). Every group or sample that is not put is
recorded with its `proto.drops.DropReason` (`engine_error`, `aborted`, ...), in groups and in
samples; none is lost silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Coroutine
from typing import Any

from redis.exceptions import RedisError

from proto import DropReason, Sample, SampleGroup
from proto.run_terms import RunTerms
from services.rollout_router.backpressure import BufferBound, full_sentence, waiting_for_room
from services.rollout_router.balancer.engine_context import none_admitted
from services.rollout_router.balancer.worker import EngineRequestError, NoWorkerError
from services.rollout_router.balancer.workers import WorkerPool
from services.rollout_router.config import RolloutConfig, SamplingConfig, depth_bound
from services.rollout_router.lease import LeaseError, raise_if_fenced
from services.rollout_router.rollout.environments import EpisodeRunner
from services.rollout_router.rollout.generation import Generation
from services.rollout_router.rollout.metrics import LoopObserver
from services.rollout_router.rollout.progress import (
    Backoff,
    Demand,
    EpochOrders,
    allowance,
    closed_gate_reason,
    engines_version,
    read_demand,
)
from services.rollout_router.rollout.recent import RecentGroups
from services.rollout_router.rollout.report import (
    BatchStats,
    Drops,
    GroupDroppedError,
    LoopSnapshot,
    RequestsRefusedError,
    busy,
    record_drop,
    refused,
)
from services.rollout_router.rollout.rewards import Reward, RewardError
from services.rollout_router.rollout.settings import LiveSettings
from services.rollout_router.rollout.tasks import Item, Task
from services.rollout_router.samples import sampling_seed
from services.sample_buffer import AsyncSampleBuffer
from services.sample_buffer.refusals import hint_of

log = logging.getLogger("tandem.router.rollout")

# Group drop reasons that say a dependency is failing: repeated, they make the loop back off.
DEPENDENCY_REASONS = {DropReason.ENGINE_ERROR, DropReason.ENV_ALL_FAILED, DropReason.REWARD_ERROR}
# Groups in a row whose requests the engines refused (HTTP 4xx: the request's fault, not an
# engine's) after which the loop stops, naming the engine's message: a setting every request
# carries is wrong, and no wait mends it. Distinct prompts: one bad prompt never gets there.
REFUSED_IN_A_ROW = 32


class RolloutLoop:
    """Produces sample groups as the demand gate allows, one task per group."""

    def __init__(
        self,
        run: RunTerms,
        config: RolloutConfig,
        sampling: SamplingConfig,
        pool: WorkerPool,
        buffer: AsyncSampleBuffer,
        task: Task,
        reward: Reward,
        stop_token_ids: list[int],
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.terms = run  # (fixed for the run: the trainer relies on them)
        self.live = LiveSettings(run, config, sampling)  # (PATCH /rollout/config replaces them)
        self.pool, self.buffer, self.task, self.reward = pool, buffer, task, reward
        self.episodes = episodes
        self.state, self.waiting_for, self.since = "idle", "", time.time()
        self.groups: set[asyncio.Task] = set()  # groups started, not yet put or dropped
        self.samples_per_s, self.groups_put, self.error = 0.0, 0, ""
        self.last_eval: dict[str, float] = {}
        self.last_eval_version = -1
        self.backoff = Backoff()
        self.refused_in_a_row = 0  # groups whose requests the engines refused (4xx), in a row
        self.redrawn: set[int] = set()  # draws given back once after a dependency failed
        self.stats = BatchStats()
        self.drops = Drops()
        self.changed = asyncio.Event()  # set on each state change (the status reporter waits)
        self._resume = asyncio.Event()
        self._resume.set()
        self._wake = asyncio.Event()  # set when a group ends
        self.bound = BufferBound(
            buffer, depth_bound(config.max_buffer_depth, run.rollout_batch_size)
        )
        self._give_backs: set[asyncio.Task] = set()  # drops of cancelled groups being written
        self._failure: BaseException | None = None  # a group task's unexpected exception
        self._redis_error: Exception | None = None
        self._redis_lost: list[str] = []  # groups lost while Redis was unavailable
        self.orders = EpochOrders()
        self.recent = RecentGroups()  # the newest put groups, for the dashboard
        self.observe = LoopObserver(buffer)  # /metrics counters and timeline spans
        self.gen = Generation(self.live, pool, stop_token_ids, self.observe)

    @property
    def config(self) -> RolloutConfig:
        """The rollout settings in force."""
        return self.live.rollout

    @property
    def sampling(self) -> SamplingConfig:
        """The sampling settings in force."""
        return self.live.sampling

    # --- versions, state and control -----------------------------------------------------------

    async def engines_version(self) -> int:
        return await engines_version(self.buffer, self.pool)

    def set_state(self, state: str, waiting_for: str = "") -> None:
        """`waiting_for`: what would unblock the loop, as a sentence a user can act on."""
        if state != self.state:
            self.observe.state_left(self.state, self.since, self.waiting_for)
            self.since = time.time()
            self.changed.set()
        self.state, self.waiting_for = state, waiting_for

    async def wait_for_workers(self) -> None:
        """With no admitted engine, every group would fail at once, and engines paused would
        hold them: wait instead of dropping."""
        while not self.pool.admitted() or self.pool.paused_at:
            waiting_for = none_admitted(self.pool)
            if self.pool.paused_at:
                waiting_for = (
                    f"the engines, paused through POST /pause_generation "
                    f"{time.time() - self.pool.paused_at:.0f} s ago: POST /continue_generation "
                    "(with the API token) resumes them"
                )
            self.set_state("waiting_for_workers", waiting_for)
            await asyncio.sleep(self.config.version_poll_s)
        if self.state == "waiting_for_workers":  # (the groups in flight go on at once)
            self.set_state("generating")

    def pause(self) -> None:
        """Start no more groups; the ones in flight finish and are put. Then wait for resume."""
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    def apply(self, rollout: RolloutConfig, sampling: SamplingConfig) -> None:
        """Use validated new settings from the next request (and the next group) on."""
        self.live.rollout, self.live.sampling = rollout, sampling
        self.gen.settings_changed()

    def snapshot(self) -> LoopSnapshot:
        """What the observers (status, metrics, the watchdog's record) are shown."""
        return LoopSnapshot(
            state=self.state,
            waiting_for=self.waiting_for,
            since=self.since,
            error=self.error,
            paused=self.paused,
            run=self.terms,
            rollout=self.config,
            groups_in_flight=len(self.groups),
            requests_in_flight=self.gen.in_flight,
            groups_put=self.groups_put,
            samples_per_s=self.samples_per_s,
            max_depth=self.bound.max_depth,
            producers_waiting=self.bound.waiting,
            busy=busy(self) if self.groups else "",
            note=self.drops.note(),
            last_eval=self.last_eval,
            last_eval_version=self.last_eval_version,
        )

    def backoff_reason(self, left_s: float) -> str:
        """What the backing-off loop waits for, as the status says it."""
        reason = self.backoff.reason
        if reason == DropReason.ENGINE_ERROR:
            what = "the engines (see GET /workers)"
        elif reason == DropReason.REWARD_ERROR:
            what = self.reward.source
        else:
            what = f"environment {self.episodes.client.url if self.episodes else '?'}"
        return self.backoff.sentence(what, left_s)

    # --- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Start groups as the gate allows, until cancelled. A Redis outage stops new groups;
        once Redis answers again, the groups it made us lose are counted (`redis_unavailable`)
        and the loop goes on. A group task's unexpected exception ends the loop (`failed`).
        First, groups a killed router left in flight are dropped, their prompts given back."""
        recovered = False
        try:
            while True:
                if self.paused:
                    await self._pause()
                if self._failure is not None:
                    raise self._failure
                try:
                    if self._redis_error is not None:
                        await self._wait_for_redis()
                    if not recovered:
                        await self.buffer.recover_in_flight("router")
                        recovered = True
                    await self.wait_for_workers()
                    started = await self._start_groups()
                except RedisError as exc:
                    self._redis_error = exc
                    continue
                if not started:
                    self._wake.clear()
                    # not wait_for: 3.11's loses a cancel that comes as the event is set
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.config.version_poll_s):
                            await self._wake.wait()
        except asyncio.CancelledError:
            self.set_state("stopped")
            await self._cancel_groups()
            raise
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.set_state("failed")
            if isinstance(exc, LeaseError):
                log.error("rollout loop stopped: %s", exc)
            else:
                log.exception("rollout loop failed")
            await self._cancel_groups()
            raise

    async def _pause(self) -> None:
        while self.groups:
            self.set_state("pausing", "the groups in flight to finish (paused on request)")
            await asyncio.wait(set(self.groups))
        self.set_state("paused", "POST /rollout/resume (the loop was paused on request)")
        await self._resume.wait()

    async def _cancel_groups(self) -> None:
        for group in (groups := list(self.groups)):
            group.cancel()
        await asyncio.gather(*groups, return_exceptions=True)
        if self._give_backs:  # bounded: a Redis that does not answer loses them (logged)
            _done, lost = await asyncio.wait(set(self._give_backs), timeout=5.0)
            if lost:
                log.warning("%d cancelled groups not recorded (Redis did not answer)", len(lost))

    async def _start_groups(self) -> int:
        """Start as many groups as the gate, the concurrency bound and the backoff allow."""
        cfg, backoff = self.config, self.backoff
        if backoff.active:
            left = backoff.until - time.monotonic()
            if left > 0 or self.groups:  # wait out the delay, then probe with one group
                self.set_state("backing_off", self.backoff_reason(left))
                return 0
        in_flight = len(self.groups)  # read before the counters: a group is never missed
        room = (cfg.rollout_max_concurrency or self.terms.rollout_batch_size) - in_flight
        if backoff.active:
            room = min(room, 1)
        if room <= 0:
            return 0
        demand = await self.read_demand(in_flight)
        n = min(room, allowance(demand, *self._gate_terms()))
        if n <= 0:
            who = "weights" if demand.engines_version < demand.trainer_version else "trainer"
            self.set_state(f"waiting_for_{who}", closed_gate_reason(demand, *self._gate_terms()))
            return 0
        if self.bound.max_depth:  # the groups in flight are put before any new one
            n = min(n, self.bound.max_depth - demand.ahead())
            if n <= 0:
                sentence = full_sentence(demand.backlog(), self.bound.max_depth)
                self._buffer_full(f"{sentence}, {in_flight} more in flight")
                return 0
        self.set_state("generating")
        for _ in range(n):
            p = await self._start_one()
            group = asyncio.create_task(self.run_group(p, self.prompt(p)), name=f"group p{p}")
            self.groups.add(group)
            group.add_done_callback(self._group_ended)
        return n

    async def _start_one(self) -> int:
        """START a group (counted generated and in flight). Cancelled meanwhile (the rollout
        stops), its draw is given back once the START has run: it stayed in flight, unrecorded."""
        start = asyncio.ensure_future(self.buffer.start_group())
        try:
            return await asyncio.shield(start)
        except asyncio.CancelledError:
            self._record_later(self._give_back(start))
            raise

    def _record_later(self, write: Coroutine[Any, Any, None]) -> None:
        """A cancelled group's drop, in a task of its own (a cancelled task cannot reliably
        await), which `_cancel_groups` waits for."""
        task = asyncio.create_task(write)
        self._give_backs.add(task)
        task.add_done_callback(self._give_backs.discard)

    def _gate_terms(self) -> tuple[int, int, int]:
        run = self.terms
        return run.rollout_batch_size, run.num_steps_per_rollout, run.max_staleness

    async def read_demand(self, in_flight: int) -> Demand:
        """The gate's inputs, read from Redis."""
        engines = await self.engines_version()
        return await read_demand(self.buffer, self.terms, in_flight, engines)

    def prompt(self, p: int) -> Item:
        """Draw p: prompt p % len(train) of epoch p // len(train)'s permutation."""
        train = self.task.train
        epoch, index = divmod(p, len(train))
        return train[self.orders.order(len(train), self.terms.seed, epoch)[index]]

    def _group_ended(self, group: asyncio.Task) -> None:
        self.groups.discard(group)
        if not group.cancelled() and group.exception() is not None:
            self._failure = group.exception()
        self._wake.set()

    async def _wait_for_redis(self) -> None:
        exc = self._redis_error
        raise_if_fenced(exc, self.buffer.config.run_id)
        self.error = f"{type(exc).__name__}: {exc}"
        hint = hint_of(exc)
        self.set_state(
            "waiting_for_redis", f"Redis at {self.buffer.config.redis_url} ({exc}){hint}"
        )
        log.warning("Redis unavailable (%s)%s; waiting for it to take writes", exc, hint)
        await self.buffer.wait_writable()
        for group_id in self._redis_lost:
            await self._drop(group_id, DropReason.REDIS_UNAVAILABLE, str(exc))
        self._redis_lost, self._redis_error, self.error = [], None, ""

    # --- one group -----------------------------------------------------------------------------

    async def run_group(self, p: int, item: Item) -> None:
        """Make, filter and put the group of draw p; a Redis error loses it (counted later)."""
        try:
            await self._group(p, item)
        except RedisError as exc:
            self._redis_lost.append(f"p{p}")
            self._redis_error = exc

    async def _group(self, p: int, item: Item) -> None:
        group_id, started = f"p{p}", time.monotonic()
        committed = [False]  # set once the XADD is under way: from then on the group is put
        try:
            group = await self.make_group(p, item, group_id)
            if self.config.dynamic_sampling and len({s.reward for s in group.samples}) == 1:
                raise GroupDroppedError(
                    DropReason.ALL_REWARDS_EQUAL,
                    f"every reward is {group.samples[0].reward}",
                    len(group.samples),
                )
            await self.put(group, committed)
        except GroupDroppedError as exc:
            self.stats.finished += 1
            reason = exc.reason
            self.refused_in_a_row = self.refused_in_a_row + 1 if exc.refused else 0
            detail, again = str(exc), None
            if (
                reason in DEPENDENCY_REASONS
                and not exc.refused
                and (reason != DropReason.REWARD_ERROR or self.reward.url)
            ):
                self.backoff.failed(reason, str(exc), started, time.monotonic())
                # its engine, environment or reward service failed: not the prompt's fault
                # (once: a prompt that takes a dependency down is not drawn forever)
                if p not in self.redrawn:
                    self.redrawn.add(p)
                    detail, again = f"{detail}; its prompt is drawn again (once)", p
            await self._drop(group_id, reason, detail, exc.samples, give_back=again)
            if broken := self.reward.broken():  # ends the loop: every group would be dropped
                raise RewardError(broken) from None
            if self.refused_in_a_row >= REFUSED_IN_A_ROW:  # so would every group here
                raise RequestsRefusedError(
                    f"the engines refused the requests of {self.refused_in_a_row} groups in a "
                    f"row ({str(exc)[:400]}): a setting every request carries is wrong (a "
                    "sampling flag of the router), not the engines; fix what the engine's "
                    "message names"
                ) from None
            return
        except asyncio.CancelledError:
            if not committed[0]:  # stopped mid-group: its prompt is drawn again next start
                self._record_later(self._give_back(p))
            raise
        self.backoff.succeeded()
        self.refused_in_a_row = 0
        self.drops.group_put()
        self.recent.add(group)
        batch = self.terms.rollout_batch_size
        if self.stats.add(group, batch):
            stats, self.stats = self.stats, BatchStats()
            self.samples_per_s = await stats.publish(
                self.buffer, batch, await self.engines_version()
            )

    async def _give_back(self, draw: int | Awaitable[int]) -> None:
        """Drop a group stopped in flight (`draw`, or a START on its way) as cancelled."""
        detail = "rollout stopped; its prompt is drawn again at the next start"
        with contextlib.suppress(RedisError):  # one DROP: the group's end and its prompt back
            p = draw if isinstance(draw, int) else await draw
            await self._drop(f"p{p}", DropReason.CANCELLED, detail, quiet=True, give_back=p)

    async def make_group(self, p: int, item: Item, group_id: str) -> SampleGroup:
        """Generate (single turns or environment episodes) and reward one prompt's group."""
        seed = sampling_seed(self.terms.seed, p)
        try:
            if self.episodes is not None:
                outcomes = await self._episode_samples(item, group_id, seed)
            else:
                outcomes = await self._single_turn_samples(item, seed)
        except (EngineRequestError, NoWorkerError) as exc:
            raise GroupDroppedError(
                DropReason.ENGINE_ERROR, str(exc), refused=refused(exc)
            ) from exc
        samples = await self._scored(group_id, outcomes)
        return SampleGroup(
            group_id=group_id,
            prompt=item.prompt,
            label=item.label,
            samples=samples,
            weight_version=min(s.weight_version for s in samples),
            created_at=time.time(),
        )

    async def _scored(self, group_id: str, outcomes: list[Sample | RewardError]) -> list[Sample]:
        """The samples with a finite reward. Each other one is dropped with its reason; when
        none is left the group is dropped instead (one record, the first sample's reason)."""
        failed: list[tuple[int, RewardError]] = []
        samples = []
        for k, outcome in enumerate(outcomes):
            if isinstance(outcome, Sample) and not math.isfinite(outcome.reward):
                outcome = RewardError(f"reward {outcome.reward}", DropReason.REWARD_NONFINITE)
            if isinstance(outcome, RewardError):
                failed.append((k, outcome))
                self.stats.reward_timed_out += outcome.timed_out
            else:
                samples.append(outcome)
        self.stats.rewards += len(outcomes)  # (the console says the share that failed)
        self.stats.reward_failed += len(failed)
        if not samples:
            error = failed[0][1]
            detail = f"all {len(outcomes)} samples: {error}"
            raise GroupDroppedError(error.reason, detail, len(outcomes))
        for k, error in failed:
            await self._drop(f"{group_id}-s{k}", error.reason, str(error), 1, groups=0, quiet=True)
        return samples

    async def _single_turn_samples(self, item: Item, seed: int) -> list[Sample | RewardError]:
        prompt_ids = list(item.input_ids)
        partials = await self.gen.partials(prompt_ids, seed)
        if any(p.finish == "abort" for p in partials):
            raise GroupDroppedError(
                DropReason.ABORTED, f"still aborted after {self.config.max_continues} tries"
            )
        rewards = await self.reward.score_all(
            item.prompt, [(p.text, p.finish) for p in partials], item.label
        )
        return [
            r if isinstance(r, RewardError) else p.to_sample(prompt_ids, r)
            for p, r in zip(partials, rewards, strict=True)
        ]

    async def _episode_samples(
        self, item: Item, group_id: str, seed: int
    ) -> list[Sample | RewardError]:
        """n episodes; a failed one is recorded as a drop and the others are kept."""
        assert self.episodes is not None
        n = self.terms.n_samples_per_prompt
        self.gen.limits = await self.buffer.sample_limits()  # the trainer's, for the cut
        samples, failed = await self.episodes.run_all(
            item, group_id, seed, n, self.gen.episode_turn
        )
        for episode_id, error in failed:
            await self._drop(episode_id, error.reason, str(error), 1, groups=0)
        if not samples:
            first = f"{failed[0][1].reason}: {failed[0][1]}"
            too_long = all(e.reason == DropReason.PROMPT_TOO_LONG for _, e in failed)
            raise GroupDroppedError(
                DropReason.PROMPT_TOO_LONG if too_long else DropReason.ENV_ALL_FAILED,
                f"all {n} episodes failed; first: {first}",
                0,
            )
        return list(samples)

    async def put(self, group: SampleGroup, committed: list[bool]) -> None:
        """Put in turn with the other producers, waiting while the buffer is full; once the
        write is queued it is shielded from cancellation and `committed[0]` is set."""
        async with self.bound.slot(None, self._buffer_full) as put_group:
            committed[0] = True
            self.groups_put += 1
            await asyncio.shield(put_group(group))
            self.observe.group_put(group, self.terms.rollout_batch_size)
            if self.state == "waiting_for_buffer":
                self.set_state("generating")

    def _buffer_full(self, sentence: str) -> None:
        self.set_state("waiting_for_buffer", waiting_for_room(sentence))

    async def _drop(
        self,
        group_id: str,
        reason: DropReason,
        detail: str,
        samples: int | None = None,
        groups: int = 1,
        quiet: bool = False,
        give_back: int | None = None,
    ) -> None:
        """`report.record_drop`; `samples` None: the whole group's n_samples_per_prompt."""
        n = self.terms.n_samples_per_prompt if samples is None else samples
        await record_drop(
            self.buffer, self.drops, group_id, reason, detail, n, groups, give_back, quiet
        )
