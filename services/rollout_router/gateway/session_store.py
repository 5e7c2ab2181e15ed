"""Agent sessions as the router holds them: each session's turns, the samples they merge into,
the groups waiting for their sessions' rewards, and the sessions a reward closed.

Memory: an open session holds its tokens once, as arrays (`Turn`): a turn whose prompt extends
the session's last context keeps only the tokens beyond it, so a session of T turns over a
context of C tokens holds ~4 B a token of C and 12 a response token, where each turn's whole
prompt as a list held ~36 B a token of every turn's context (T x C). The samples of sessions
waiting for their group are held packed, as the buffer stores them. bench/session_memory.py
measures both.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from proto import Sample
from proto.packed import IDS, LOGPROBS, PackedSample
from services.rollout_router.config import SessionConfig
from services.rollout_router.samples import Partial, drawn_at


@dataclass
class Turn:
    """A chat turn as its session holds it: `prompt` is the tokens beyond the session's last
    context (its last prompt and response) when the prompt starts with that context exactly
    (`extends`: the turn merges into the sample, docs/protocols.md), else the whole prompt;
    the response's ids, log-probs (float32, as the buffer stores them) and token versions as
    arrays, and the rest of its `Partial`."""

    prompt: array
    extends: bool
    ids: array
    logprobs: array
    versions: array
    text: str
    finish: str
    segment_versions: list[int]
    routed_experts: str
    temperature: float  # the turn's sampling temperature (`Partial.temperature`)

    @classmethod
    def of(cls, prompt: array, extends: bool, partial: Partial) -> Turn:
        return cls(
            prompt,
            extends,
            array(IDS, partial.ids),
            array(LOGPROBS, partial.logprobs),
            array(IDS, partial.token_versions),
            partial.text,
            partial.finish,
            partial.segment_versions,
            partial.routed_experts,
            partial.temperature,
        )

    def partial(self) -> Partial:
        """The response as a `Partial` of lists."""
        return Partial(
            ids=self.ids.tolist(),
            logprobs=self.logprobs.tolist(),
            token_versions=self.versions.tolist(),
            text=self.text,
            finish=self.finish,
            segment_versions=list(self.segment_versions),
            routed_experts=self.routed_experts,
            temperature=self.temperature,
        )


@dataclass
class Session:
    session_id: str
    turns: list[Turn] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    context: array = field(default_factory=lambda: array(IDS))  # the last prompt + response

    def record(self, prompt_ids: list[int], partial: Partial) -> None:
        """Hold one turn; OverflowError when a token id is no int32."""
        prompt = array(IDS, prompt_ids)
        n = len(self.context)
        extends = bool(self.turns) and prompt[:n] == self.context
        turn = Turn.of(prompt[n:] if extends else prompt, extends, partial)
        self.turns.append(turn)
        self.context = prompt + turn.ids

    def response_before(self, prompt_ids: list[int]) -> int:
        """Response tokens a turn on `prompt_ids` finds in the sample it merges into: the
        tokens after that sample's first prompt (0: the turn starts a sample)."""
        n = len(self.context)
        if not self.turns or self.context.tolist() != prompt_ids[:n]:
            return 0
        start = next(turn for turn in reversed(self.turns) if not turn.extends)
        return len(prompt_ids) - len(start.prompt)


def session_samples(session: Session, reward: float) -> list[Sample]:
    """The session's turns merged by exact prefix (docs/protocols.md). A turn at another
    temperature than the sample it extends starts a sample of its own (its prompt the whole
    context): a sample is scored at one temperature."""
    samples: list[Sample] = []
    prompt: list[int] = []
    current: Partial | None = None
    mask: list[int] = []
    for turn in session.turns:
        partial = turn.partial()
        start = turn.prompt.tolist()
        if (
            current is not None
            and turn.extends
            and drawn_at(turn.temperature) != drawn_at(current.temperature)
        ):
            start = prompt + current.ids + start  # (the whole context: the sample's prompt)
        elif current is not None and turn.extends:
            current.extend_unsampled(start)  # (the messages between the turns)
            mask += [0] * len(start)
            current.extend_partial(partial)
            mask += [1] * len(partial.ids)
            continue
        if current is not None:
            samples.append(_finish(current, prompt, mask, reward))
        prompt, mask = start, [1] * len(partial.ids)
        current = Partial()
        current.extend_partial(partial)
    if current is not None:
        samples.append(_finish(current, prompt, mask, reward))
    return samples


def _finish(partial: Partial, prompt: list[int], mask: list[int], reward: float) -> Sample:
    sample = partial.to_sample(prompt, reward)
    sample.loss_mask = mask
    return sample


class GroupSizeError(ValueError):
    """A session's reward names a group_size other than its group's (answered 409)."""


@dataclass
class PendingGroup:
    """Samples of the sessions of one group that have reported so far."""

    created: float
    size: int  # sessions that make it (its first reward's group_size)
    samples: list[PackedSample] = field(default_factory=list)
    sessions: int = 0


class SessionStore:
    """Open sessions and pending groups, bounded in number and age; the last `max_sessions`
    sessions a reward closed, with what it did (an agent's retry of a reward that was taken is
    told so, not that the session is unknown)."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.groups: dict[str, PendingGroup] = {}
        self.rewarded: OrderedDict[str, str] = OrderedDict()

    def record(self, session_id: str, prompt_ids: list[int], partial: Partial) -> None:
        session = self.sessions.get(session_id)
        if session is None:  # (an id a reward closed names a new session from here on)
            session = self.sessions[session_id] = Session(session_id)
            self.rewarded.pop(session_id, None)
        session.record(prompt_ids, partial)

    def closed_by_reward(self, session_id: str, what: str) -> None:
        self.rewarded[session_id] = what
        while len(self.rewarded) > self.config.max_sessions:
            self.rewarded.popitem(last=False)

    def response_before(self, session_id: str, prompt_ids: list[int]) -> int:
        """`Session.response_before` (0 for a new session)."""
        session = self.sessions.get(session_id)
        return session.response_before(prompt_ids) if session is not None else 0

    def close(self, session_id: str) -> Session:
        """Remove and return the session; KeyError when unknown (or expired)."""
        return self.sessions.pop(session_id)

    def undo_close(self, session_id: str, group: str | None) -> Callable[[], None]:
        """What puts the session and its group back as they are now: a reward whose put Redis
        refused leaves them open for the agent's retry (they were lost, unrecorded)."""
        session, pending = self.sessions[session_id], self.groups.get(group or "")
        had = (len(pending.samples), pending.sessions) if pending else (0, 0)

        def undo() -> None:
            self.sessions[session_id] = session
            if pending is not None and group:
                del pending.samples[had[0] :]
                pending.sessions = had[1]
                self.groups[group] = pending

        return undo

    def completes(self, group: str | None, size: int) -> bool:
        """Whether one more session's reward puts a group (a lone session always does);
        GroupSizeError when `size` is not the group_size its sessions so far gave."""
        pending = self.groups.get(group) if group else None
        if pending is not None and pending.size != size:
            raise GroupSizeError(
                f"group {group!r} has {pending.sessions} of its {pending.size} sessions "
                f"(group_size {pending.size} in its first reward), but this reward says "
                f"group_size {size}: give every session of a group the same group_size"
            )
        return not group or (pending.sessions if pending else 0) + 1 >= size

    def add_to_group(
        self, group: str, samples: list[PackedSample], size: int
    ) -> list[PackedSample] | None:
        """Collect samples under `group`; all of them once `size` sessions have reported."""
        pending = self.groups.setdefault(group, PendingGroup(time.monotonic(), size))
        pending.samples += samples
        pending.sessions += 1
        if pending.sessions < size:
            return None
        del self.groups[group]
        return pending.samples

    def expire(self) -> list[str]:
        """Drop sessions and groups past their age or beyond `max_sessions`; their ids."""
        now, ttl = time.monotonic(), self.config.session_ttl_s
        gone = [sid for sid, s in self.sessions.items() if now - s.created > ttl]
        while len(self.sessions) - len(gone) > self.config.max_sessions:
            gone.append(next(sid for sid in self.sessions if sid not in gone))
        for sid in gone:
            self.sessions.pop(sid, None)
        stale = [g for g, p in self.groups.items() if now - p.created > ttl]
        for g in stale:
            self.groups.pop(g)
        return gone + [f"group:{g}" for g in stale]
