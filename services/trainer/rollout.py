"""Rank 0's intake of sample groups from the buffer: read, check, dead-letter, drop stale.

Reads (`Intake.read_rollout`) until `rollout_batch_size` groups fit to train are in hand:
  first, once per start, the entries pending since before the start: those of consumers idle
  for `reclaim_min_idle_s` (a trainer gone for good, whatever its --consumer) are claimed
  (XAUTOCLAIM), then every entry pending for this consumer is read, in stream order;
  then new entries, each blocking read waiting at most `read_block_ms` (so a stop is seen),
  the next read under way while the groups of the last are checked (sample_buffer/read_ahead.py:
  at most one read's entries beyond the rollout, pending like any entry in hand).
An entry holds one group or several (the router's group commit, proto/packed.py); a group is
known by its key `entry/index`, and groups of an entry read beyond the rollout wait in hand for
the next. Each group is checked (`intake.check_groups`) before it may reach a batch. A bad one
(or a whole entry that does not decode) is moved to the dead-letter stream and recorded as a
`DropReason.DEAD_LETTERED` drop whose detail names the `DeadLetterReason` (the first of each
reason is logged with its detail, later ones as counts), in one transaction that also writes
the entry's good groups again as a new entry and acks the old one: it never stops the trainer,
and no group is lost or counted twice. A group a loaded checkpoint already trained is skipped;
one older than `max_staleness` versions is recorded as a stale drop. An entry is acked once
every group of it is done with (trained or dropped stale, and in a checkpoint: `ack_done`);
until then the keys of its done groups go into each checkpoint (`checkpoint_keys`), so a resume
trains the rest of the entry and nothing twice. Every group done with for good (trained, stale,
dead-lettered) counts in the run's `groups_consumed`, which the router's demand gate reads.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from proto import DropRecord
from proto.drops import DeadLetterReason, DropReason
from proto.packed import PackedGroup, encode_entry, entry_of, pack
from services.sample_buffer import SampleBuffer
from services.sample_buffer.buffer import DeadLetter, Entry
from services.sample_buffer.read_ahead import ReadAhead
from services.trainer import batching
from services.trainer.config import TrainerConfig
from services.trainer.intake import Group, Limits, Rejected, check_groups, decode_groups, foreign

log = logging.getLogger("tandem.trainer")
# Entries taken in the one read that drains the pending list at start-up; the stream holds at
# most --max-buffer-depth untrained groups plus save_interval rollouts, far fewer than this.
RESUME_READ_MAX = 1_000_000
# While reads return groups back to back, the most often the intake reads the counters for its
# status (and writes it): at each read, two Redis round trips of four per read were a third of
# the intake's CPU (bench/buffer_throughput.py). The status is then at most this plus one read
# (--read-block-ms) old.
WAIT_REPORT_S = 0.25
# Groups dead-lettered in a row, none fit to train among them, after which the trainer stops
# naming the last one's reason: the samples do not fit this trainer (its --max-tokens-per-gpu,
# its model's vocabulary, another Tandem version), and waiting mends nothing. A bad group among
# good ones resets nothing but itself. Versions from the buffer's past (another lineage, a
# version this trainer has not published) do not count: a backlog of them drains by itself.
DEAD_LETTERS_IN_A_ROW = 256
# Entries written outside the router's path are not this trainer's to fit either.
FOREIGN = DeadLetterReason.FOREIGN_ENTRY
PAST = (DeadLetterReason.FOREIGN_LINEAGE, DeadLetterReason.FUTURE_VERSION, FOREIGN)


class DeadLettersError(RuntimeError):
    """DEAD_LETTERS_IN_A_ROW groups dead-lettered in a row."""


@dataclass
class Rollout:
    """Groups to train on (with their keys) and how many samples were dropped stale."""

    entry_ids: list[str]  # the groups' keys, `entry/index`
    groups: list[Group]
    dropped_stale: int
    staleness_counts: dict[int, int]


class Intake:
    """Reads rollouts for the trainer at `version`; holds the ids waiting for their ack.
    States its `limits` to the run at once (the router holds its PATCHes to them)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        buffer: SampleBuffer,
        limits: Limits,
        report: Callable[..., None],
    ) -> None:
        self.cfg, self.buffer, self.limits, self.report = cfg, buffer, limits, report
        buffer.set_limits(limits.stated())
        self.lineage_floor = 0  # --new-lineage: groups stamped below it are foreign
        self.published_before = 0  # on resume: the highest version published before the crash
        self.pending_first = True  # after a (re)start, groups read but never acked come first
        self.backlog: list[Entry] = []  # read from Redis, not yet used
        self.ahead = ReadAhead(buffer, cfg.batch.consumer)  # new entries, one read ahead
        self.in_hand: list[tuple[str, Group]] = []  # checked groups beyond the last rollout
        self.open: dict[str, int] = {}  # entry id -> its groups not yet done and checkpointed
        self.held: set[str] = set()  # keys of groups done and checkpointed of open entries
        self.unacked: list[str] = []  # keys trained or dropped stale, waiting for a checkpoint
        self.already_trained: set[str] = set()  # keys (or entry ids) a loaded checkpoint holds
        self.dead_lettered: Counter[str] = Counter()
        self.letters_in_a_row, self.last_letter = 0, ""  # since the last group fit to train
        self.reported_at = -math.inf  # monotonic time of the last status while reading

    def read_rollout(self, version: int, stop: Callable[[], bool]) -> Rollout | None:
        """`rollout_batch_size` groups fit to train at `version` (None: a stop was requested)."""
        rollout = Rollout([], [], 0, {})
        need = self.cfg.run.rollout_batch_size
        while len(rollout.groups) < need:
            if stop():
                return None
            if not self.in_hand:
                self._report_waiting(len(rollout.groups), version)
                for entry_id, fields in self._next_entries(need - len(rollout.groups)):
                    self.in_hand += self._take_entry(entry_id, fields, version)
            taken = need - len(rollout.groups)
            checked, self.in_hand = self.in_hand[:taken], self.in_hand[taken:]
            fresh, stale = batching.split_stale(checked, version, self.cfg.run.max_staleness)
            for key, group in stale:
                self._drop_stale(key, group, version)
                rollout.dropped_stale += len(group.samples)
            for key, group in fresh:
                rollout.entry_ids.append(key)
                rollout.groups.append(group)
        return rollout

    def _take_entry(
        self, entry_id: str, fields: dict[bytes, bytes], version: int
    ) -> list[tuple[str, Group]]:
        """The groups of an entry fit to train, not trained yet; the rest dead-lettered (the
        good ones then come back as a new entry) or, trained by the loaded checkpoint, held."""
        groups = decode_groups(entry_id, fields)
        if b"n" not in fields:  # written outside the router's path: no PUT counted it put
            self._dead_letter(entry_id, [(entry_id, fields, foreign(groups))], [], version)
            return []
        if isinstance(groups, Rejected):
            self._dead_letter(entry_id, [(entry_id, fields, groups)], [], version)
            return []
        whole = entry_id in self.already_trained  # (a checkpoint older than group keys)
        done = {k for k, _ in groups if whole or k in self.already_trained}
        newest = max(version, self.published_before)  # a stamp above it is from the future
        good, bad = [], []
        todo = [(key, group) for key, group in groups if key not in done]
        verdicts = check_groups([g for _, g in todo], self.limits, newest, self.lineage_floor)
        for (key, group), checked in zip(todo, verdicts, strict=True):
            if isinstance(checked, Rejected):
                if len(groups) == 1:  # the whole entry, as it was
                    bad.append((entry_id, fields, checked))
                else:
                    bad.append((key, {b"d": encode_entry([pack(group)])}, checked))
            else:
                good.append((key, checked))
        if bad:
            self._dead_letter(entry_id, bad, [pack(g) for _, g in good], version)
            return []
        if not good:  # every group in the loaded checkpoint; only the ack was lost
            self.buffer.ack([entry_id])
            return []
        self.letters_in_a_row = 0
        self.open[entry_id] = len(good)
        self.held.update(done)
        return good

    def _next_entries(self, count: int) -> list[Entry]:
        """Up to `count` entries: first (once per start) every entry pending for this consumer,
        after claiming those of idle consumers, in stream order; then new ones."""
        consumer = self.cfg.batch.consumer
        if self.pending_first:
            self.pending_first = False
            idle_s = self.cfg.batch.reclaim_min_idle_s
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
        return self.ahead.read(count, self.cfg.batch.read_block_ms)

    def _report_waiting(self, in_hand: int, version: int) -> None:
        """Status while the rollout is incomplete (called before each read), at most every
        WAIT_REPORT_S."""
        now = time.monotonic()
        if now - self.reported_at < WAIT_REPORT_S:
            return
        self.reported_at = now
        need, (counters, depth) = self.cfg.run.rollout_batch_size, self.buffer.counters_and_depth()
        put, consumed = counters.get("groups_put", 0), counters.get("groups_consumed", 0)
        known = in_hand + len(self.in_hand) + len(self.unacked) + len(self.held)
        untrained = max(depth - known, 0)  # not yet in hand
        letters = (
            f"; the last {self.letters_in_a_row} groups were dead-lettered, the last as "
            f"{self.last_letter[:300]}"
            if self.letters_in_a_row
            else ""
        )
        if not put:  # (a router on another run waits for a trainer meanwhile, never a word here)
            letters += (
                f"; no group was ever put in run {self.cfg.run.run_id!r} at {self.cfg.run.redis_url} "
                "(a router still starting, or one with another --run-id or --redis-url)"
            )
        self.report(
            "waiting for samples",
            f"sample groups: {in_hand} of {need} for step {version + 1} (buffer holds "
            f"{untrained} untrained; groups put {put}, consumed {consumed}){letters}",
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
        self,
        entry_id: str,
        bad: list[tuple[str, dict[bytes, bytes], Rejected]],
        keep: list[PackedGroup],
        version: int,
    ) -> None:
        """Move bad groups (or a whole bad entry) out of the stream for good, counted as
        consumed at once (the router replaces them); the entry's groups to `keep` are written
        again as a new entry. Logged with the detail the first time per reason, then as counts."""
        letters = []
        for key, fields, why in bad:
            drop = DropRecord(
                # A foreign entry's groups were never put: counted generated as they are
                # dropped (a drop not of a consumer, ledger.py), never consumed.
                source="stream" if why.reason == FOREIGN else "trainer",
                reason=DropReason.DEAD_LETTERED,
                count=why.count,
                samples=why.samples,
                group_id=why.group_id,
                weight_version=why.weight_version,
                detail=f"{why.reason}: {why.detail}",
            )
            letters.append((DeadLetter(key, why.reason, why.detail, fields), drop))
        self.buffer.dead_letter_groups(entry_id, letters, keep)
        self.count_consumed(sum(why.reason != FOREIGN for _key, _fields, why in bad))
        unfit = [why for _key, _fields, why in bad if why.reason not in PAST]
        if unfit:
            self.letters_in_a_row += len(unfit)
            self.last_letter = f"{unfit[-1].reason}: {unfit[-1].detail}"
        if self.letters_in_a_row >= DEAD_LETTERS_IN_A_ROW:
            raise DeadLettersError(
                f"the last {self.letters_in_a_row} groups were all dead-lettered (none fit to "
                f"train among them), the last as {self.last_letter[:500]}: the samples do not "
                "fit this trainer; fix what that names"
            )
        for key, _fields, why in bad:
            self.dead_lettered[why.reason] += 1
            n = self.dead_lettered[why.reason]
            if n == 1:
                print(
                    f"[trainer] entry {key} moved to {self.buffer.dead_letter_key} "
                    f"({why.reason}, at version {version}): {why.detail}",
                    flush=True,
                )
            elif math.log10(n).is_integer():
                print(f"[trainer] {n} entries dead-lettered as {why.reason} so far", flush=True)

    def checkpoint_keys(self) -> list[str]:
        """The keys a checkpoint records as trained: done and not yet acked."""
        return [*self.held, *self.unacked]

    def ack_done(self) -> None:
        """Once a checkpoint holds them (or none is kept): ack each entry whose every group is
        done (`finished`)."""
        self.buffer.ack(self.finished())

    def finished(self) -> list[str]:
        """The entries whose every group is done, to ack now (the keys of the others are held
        until theirs are)."""
        finished = []
        for key in self.unacked:
            entry = entry_of(key)
            left = self.open.get(entry, 1) - 1  # an entry not read this run: of one group
            if left > 0:
                self.open[entry] = left
                self.held.add(key)
            else:
                self.open.pop(entry, None)
                finished.append(entry)
        gone = set(finished)
        self.held = {k for k in self.held if entry_of(k) not in gone}
        self.unacked.clear()
        return finished

    def _drop_stale(self, key: str, group: Group, version: int) -> None:
        detail = f"trainer at version {version}, max_staleness {self.cfg.run.max_staleness}"
        self._drop_group(group, DropReason.STALE, detail)
        # Acked with the trained groups (after their checkpoint), counted now: the router
        # replaces it at once, and a resume that resets the counter drops it again.
        self.unacked.append(key)
        self.count_consumed(1)

    def drop_skipped(self, groups: list[Group], version: int) -> None:
        """Groups whose step's update was skipped (non-finite loss or gradient): not trained."""
        for group in groups:
            detail = f"the update of step {version} was skipped (non-finite)"
            self._drop_group(group, DropReason.SKIPPED_UPDATE, detail)

    def _drop_group(self, group: Group, reason: DropReason, detail: str) -> None:
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
