"""Rank 0's intake of sample groups from the buffer: read, check, dead-letter, drop stale.

Reads (`Intake.read_rollout`) until `rollout_batch_size` groups fit to train are in hand:
  first, once per start, the entries pending since before the start: those of consumers idle
  for `reclaim_min_idle_s` (a trainer gone for good, whatever its --consumer) are claimed
  (XAUTOCLAIM), then every entry pending for this consumer is read, in stream order;
  then new entries, each blocking read waiting at most `read_block_ms` (so a stop is seen).
Each entry is checked (`intake.check_entry`) before it may reach a batch. A bad one is moved to
the dead-letter stream, acked, and recorded as a `DropReason.DEAD_LETTERED` drop whose detail
names the `DeadLetterReason` (the first of each reason is logged with its detail, later ones as
counts); it never stops the trainer. A group a loaded checkpoint already trained is acked and
skipped; one older than `max_staleness` versions is recorded as a stale drop and acked with the
trained groups. Every group done with for good (trained, stale, dead-lettered) counts in the
run's `groups_consumed`, which the router's demand gate reads.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from proto import DropRecord, SampleGroup
from proto.drops import DropReason
from services.sample_buffer import SampleBuffer
from services.sample_buffer.buffer import Entry
from services.trainer import batching
from services.trainer.config import TrainerConfig
from services.trainer.intake import Limits, Rejected, check_entry

log = logging.getLogger("tandem.trainer")
# Entries taken in the one read that drains the pending list at start-up; the stream holds at
# most --max-buffer-depth untrained groups plus save_interval rollouts, far fewer than this.
RESUME_READ_MAX = 1_000_000


@dataclass
class Rollout:
    """Groups to train on (with their stream ids) and how many samples were dropped stale."""

    entry_ids: list[str]
    groups: list[SampleGroup]
    dropped_stale: int
    staleness_counts: dict[int, int]


class Intake:
    """Reads rollouts for the trainer at `version`; holds the ids waiting for their ack."""

    def __init__(
        self,
        cfg: TrainerConfig,
        buffer: SampleBuffer,
        limits: Limits,
        report: Callable[..., None],
    ) -> None:
        self.cfg, self.buffer, self.limits, self.report = cfg, buffer, limits, report
        self.lineage_floor = 0  # --new-lineage: groups stamped below it are foreign
        self.published_before = 0  # on resume: the highest version published before the crash
        self.pending_first = True  # after a (re)start, groups read but never acked come first
        self.backlog: list[Entry] = []  # read from Redis, not yet used
        self.unacked: list[str] = []  # trained or dropped stale, waiting for a checkpoint
        self.already_trained: set[str] = set()  # pending ids a loaded checkpoint already holds
        self.dead_lettered: Counter[str] = Counter()

    def read_rollout(self, version: int, stop: Callable[[], bool]) -> Rollout | None:
        """`rollout_batch_size` groups fit to train at `version` (None: a stop was requested)."""
        rollout = Rollout([], [], 0, {})
        while len(rollout.groups) < self.cfg.rollout_batch_size:
            if stop():
                return None
            self._report_waiting(len(rollout.groups), version)
            read = self._next_entries(self.cfg.rollout_batch_size - len(rollout.groups))
            if self.already_trained:  # in the loaded checkpoint; only their ack was lost
                self.buffer.ack([i for i, _ in read if i in self.already_trained])
                read = [(i, f) for i, f in read if i not in self.already_trained]
            checked = []
            for entry_id, fields in read:
                newest = max(version, self.published_before)  # a stamp above it is from the future
                group = check_entry(fields, self.limits, newest, self.lineage_floor)
                if isinstance(group, Rejected):
                    self._dead_letter(entry_id, fields, group, version)
                else:
                    checked.append((entry_id, group))
            fresh, stale = batching.split_stale(checked, version, self.cfg.max_staleness)
            for entry_id, group in stale:
                self._drop_stale(entry_id, group, version)
                rollout.dropped_stale += len(group.samples)
            for entry_id, group in fresh:
                rollout.entry_ids.append(entry_id)
                rollout.groups.append(group)
        return rollout

    def _next_entries(self, count: int) -> list[Entry]:
        """Up to `count` entries: first (once per start) every entry pending for this consumer,
        after claiming those of idle consumers, in stream order; then new ones."""
        consumer = self.cfg.consumer
        if self.pending_first:
            self.pending_first = False
            idle_s = self.cfg.reclaim_min_idle_s
            claimed = self.buffer.reclaim(consumer, int(idle_s * 1000))
            if claimed:
                print(
                    f"[trainer] took over {claimed} pending groups idle for {idle_s:.0f}s or "
                    "more (--reclaim-min-idle-s), whichever consumer read them",
                    flush=True,
                )
            # One read drains the whole pending list (it can exceed a rollout when acks wait
            # for checkpoints); new groups are read after it.
            self.backlog = self.buffer.read_entries(consumer, RESUME_READ_MAX, "0")
        if self.backlog:
            taken, self.backlog = self.backlog[:count], self.backlog[count:]
            return taken
        return self.buffer.read_entries(consumer, count, ">", self.cfg.read_block_ms)

    def _report_waiting(self, in_hand: int, version: int) -> None:
        """Status while the rollout is incomplete (called each time a blocking read wakes)."""
        need, counters = self.cfg.rollout_batch_size, self.buffer.counters()
        put, consumed = counters.get("groups_put", 0), counters.get("groups_consumed", 0)
        untrained = max(self.buffer.depth() - in_hand - len(self.unacked), 0)  # not yet in hand
        self.report(
            "waiting for samples",
            f"sample groups: {in_hand} of {need} for step {version + 1} (buffer holds "
            f"{untrained} untrained; groups put {put}, consumed {consumed})",
            groups_in_hand=in_hand,
            groups_needed=need,
            groups_put=put,
            groups_consumed=consumed,
        )

    def count_consumed(self, groups: int) -> None:
        """The run's `groups_consumed` counter, which the router's demand gate reads."""
        if groups:
            self.buffer.incr_counter("groups_consumed", groups)

    def _dead_letter(
        self, entry_id: str, fields: dict[bytes, bytes], bad: Rejected, version: int
    ) -> None:
        """Move a bad entry out of the stream for good (counted as consumed at once: the router
        replaces it). Logged with its detail the first time per reason, then as counts."""
        drop = DropRecord(
            source="trainer",
            reason=DropReason.DEAD_LETTERED,
            samples=bad.samples,
            group_id=bad.group_id,
            weight_version=bad.weight_version,
            detail=f"{bad.reason}: {bad.detail}",
        )
        self.buffer.dead_letter(entry_id, fields, bad.reason, bad.detail, drop)
        self.count_consumed(1)
        self.dead_lettered[bad.reason] += 1
        n = self.dead_lettered[bad.reason]
        if n == 1:
            print(
                f"[trainer] entry {entry_id} moved to {self.buffer.dead_letter_key} "
                f"({bad.reason}, at version {version}): {bad.detail}",
                flush=True,
            )
        elif math.log10(n).is_integer():
            print(f"[trainer] {n} entries dead-lettered as {bad.reason} so far", flush=True)

    def _drop_stale(self, entry_id: str, group: SampleGroup, version: int) -> None:
        detail = f"trainer at version {version}, max_staleness {self.cfg.max_staleness}"
        self._drop_group(group, DropReason.STALE, detail)
        # Acked with the trained groups (after their checkpoint), counted now: the router
        # replaces it at once, and a resume that resets the counter drops it again.
        self.unacked.append(entry_id)
        self.count_consumed(1)

    def drop_skipped(self, groups: list[SampleGroup], version: int) -> None:
        """Groups whose step's update was skipped (non-finite loss or gradient): not trained."""
        for group in groups:
            detail = f"the update of step {version} was skipped (non-finite)"
            self._drop_group(group, DropReason.SKIPPED_UPDATE, detail)

    def _drop_group(self, group: SampleGroup, reason: DropReason, detail: str) -> None:
        """Record a put group the trainer will not train (one group, its samples)."""
        record = DropRecord(
            source="trainer",
            reason=reason,
            samples=len(group.samples),
            group_id=group.group_id,
            weight_version=group.weight_version,
            detail=detail,
        )
        self.buffer.record_drop(record)
