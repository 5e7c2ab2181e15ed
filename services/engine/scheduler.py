"""Continuous batching: one generation thread drives the model over every running sequence.

Concurrency (the only place with threads):
- HTTP handlers (asyncio thread) call `submit`, `abort`, `pause`, `resume` and `run_exclusive`;
  each takes the condition lock briefly and wakes the generation thread.
- The generation thread loops: apply aborts; run a queued exclusive command once it may (a
  draining one, such as a weight update, waits until no sequence runs and admits none
  meanwhile; arrivals wait in the queue, they are not rejected); admit waiting sequences
  (prefill, first token); decode one token for every running sequence. It sleeps on the
  condition when there is nothing to do and is woken by any of the calls above.
- Results go back through each job's `notify(job, finished)` callback, called on the generation
  thread; the server turns that into an asyncio wake-up.

Queue bound: `max_queued_requests` jobs may wait; beyond it `submit` raises `QueueFullError`
(HTTP 503) so memory stays bounded under overload. Running sequences are bounded by
`max_batch_size`.

A sequence is never produced from two weight versions unless the caller paused in place and
updated weights meanwhile (SGLang's partial-rollout mode); even then its KV cache is recomputed
with the new weights before it continues.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from services.engine.model_runner import KVCache, ModelRunner, Score
from services.engine.prompt_cache import PromptCache
from services.engine.sampling import SamplingParams, row_params, sample

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; answered with HTTP 503."""


@dataclass(eq=False)
class Sequence:
    """One sample: a prompt, its sampling parameters and seed, and what was generated so far."""

    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    job: Job
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    weight_version: int = 0
    top_logprobs_num: int = 0
    retractions: int = 0
    input_logprob_start: int | None = None  # score prompt tokens from here (logprob_start_len)
    input_logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    return_routed_experts: bool = False
    # the experts each MoE layer chose at positions [0, prompt + output - 1), taken from the
    # KV cache when the sequence ends (`[positions, moe_layers, top_k]`)
    routed_experts: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Job:
    """One prompt of one HTTP request and its `n` sequences. `notify(job, finished)` is called
    on the generation thread after progress (if `stream`) and once when every sequence ended."""

    rid: str
    sequences: list[Sequence]
    notify: Callable[[Job, bool], None]
    stream: bool = False
    created_s: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.sequences)


@dataclass(eq=False)
class _Command:
    fn: Callable[[], Any]
    drain: bool
    future: Future = field(default_factory=Future)


class Scheduler:
    """Owns the waiting queue, the running batch and its KV cache; see the module docstring."""

    def __init__(
        self,
        runner: ModelRunner,
        max_batch_size: int,
        max_prefill_tokens: int,
        max_queued_requests: int,
        context_length: int,
        weight_version: int,
        max_total_tokens: int = 0,
        prompt_cache_tokens: int = 0,
    ) -> None:
        self.runner = runner
        # prompts prefilled before; cleared by `clear_caches` on every weight change
        self.prompt_cache = PromptCache(prompt_cache_tokens)
        # KV cache bound: rows x the longest row a running sequence may reach (0 = unbounded)
        self.max_total_tokens = max_total_tokens
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued_requests = max_queued_requests
        self.context_length = context_length
        self.weight_version = weight_version
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._queued_jobs = 0
        self._running: list[Sequence] = []
        self._cache: KVCache | None = None
        self._commands: deque[_Command] = deque()
        self._aborts: list[tuple[str | None, str]] = []
        self._paused = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-generation", daemon=True)
        self.stats = {"generated_tokens": 0, "forward_passes": 0}

    # ---- called from HTTP handlers ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The generation thread runs (False once it died or was stopped)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs (one HTTP request's prompts, together or not at all)."""
        with self._cond:
            if self._queued_jobs + len(jobs) > self.max_queued_requests:
                raise QueueFullError(
                    f"{self._queued_jobs} requests are already waiting "
                    f"(--max-queued-requests {self.max_queued_requests})"
                )
            self._queued_jobs += len(jobs)
            for job in jobs:
                self._waiting.extend(job.sequences)
            self._cond.notify_all()

    def abort(self, rid: str | None, message: str = "Abort requested") -> None:
        """Abort one request (by its rid or a sequence id) or, with `rid=None`, all of them."""
        with self._cond:
            self._aborts.append((rid, message))
            self._cond.notify_all()

    def pause(self, mode: str) -> Future:
        """Stop generating. `abort`: end every request now (partial output, abort reason);
        `in_place`: keep running sequences and their cache; `retract`: keep them, drop their
        cache. Resolves once the generation thread has stopped between steps."""
        if mode == "abort":
            self.abort(None, "Abort due to pause_generation")

        def apply() -> None:
            with self._cond:
                self._paused = True
            if mode == "retract":
                self._retract_running()

        return self.run_exclusive(apply, drain=False)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def run_exclusive(self, fn: Callable[[], Any], drain: bool = True) -> Future:
        """Run `fn` on the generation thread between steps. With `drain`, first let running
        sequences finish, starting none (if paused, retract them instead: their cache is
        recomputed after `fn`). The future carries `fn`'s result or exception."""
        command = _Command(fn, drain)
        with self._cond:
            self._commands.append(command)
            self._cond.notify_all()
        return command.future

    def cancel(self, future: Future) -> bool:
        """Withdraw a command that has not started; False if it already runs or ran."""
        with self._cond:
            for command in self._commands:
                if command.future is future:
                    self._commands.remove(command)
                    return command.future.cancel()
        return False

    def clear_caches(self) -> None:
        """Forget every cached prompt (generation thread only: call through `run_exclusive`)."""
        self.prompt_cache.clear()

    def load(self) -> dict[str, int]:
        with self._cond:
            running_tokens = sum(len(s.prompt) + len(s.output_ids) for s in self._running)
            return {
                "num_running_reqs": len(self._running),
                "num_waiting_reqs": len(self._waiting),
                "num_tokens": running_tokens,
                "paused": int(self._paused),
            }

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._running and not self._waiting

    # ---- the generation thread --------------------------------------------------------------

    def _loop(self) -> None:
        self.runner.bind_thread()
        while True:
            with self._cond:
                while not self._stopped and not self._has_work():
                    self._cond.wait()
                if self._stopped:
                    break
                aborts, self._aborts = self._aborts, []
                command = self._next_command()
                admit = [] if command or self._commands or self._paused else self._pop_admissible()
            try:
                if aborts:
                    self._apply_aborts(aborts)
                if command is not None:
                    self._run_command(command)
                    continue
                if admit:
                    self._admit(admit)
                if self._running and not self._paused:
                    self._decode_step()
            except Exception as exc:  # a bug or OOM must not kill the thread silently
                log.exception("generation step failed")
                self._fail_all(f"engine error: {exc!r}")
        self._fail_all("engine shutting down")

    def _has_work(self) -> bool:
        if self._aborts or self._commands:
            return True
        return not self._paused and bool(self._running or self._waiting)

    def _next_command(self) -> _Command | None:
        if not self._commands:
            return None
        head = self._commands[0]
        if head.drain and self._running and not self._paused:
            return None  # keep decoding until the running batch is empty
        return self._commands.popleft()

    def _run_command(self, command: _Command) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        if command.drain and self._running:
            self._retract_running()
        try:
            command.future.set_result(command.fn())
        except BaseException as exc:
            command.future.set_exception(exc)

    def _retract_running(self) -> None:
        """Drop the running batch's cache; its sequences go back to the queue front and are
        re-prefilled (prompt + output so far) when they next run."""
        for seq in self._running:
            seq.retractions += 1
        with self._cond:
            self._waiting.extendleft(reversed(self._running))
            self._running, self._cache = [], None

    def _final_length(self, seq: Sequence) -> int:
        return min(len(seq.prompt) + seq.params.max_new_tokens, self.context_length)

    def _pop_admissible(self) -> list[Sequence]:
        """Waiting sequences to start now, in arrival order, within the batch size, the prefill
        budget and the KV cache bound (the cache is padded to its longest row)."""
        rows = len(self._running)
        out: list[Sequence] = []
        tokens = 0
        longest = max((self._final_length(s) for s in self._running), default=0)
        while self._waiting and rows + len(out) < self.max_batch_size:
            seq = self._waiting[0]
            size = len(seq.prompt) + len(seq.output_ids)
            if out and tokens + size > self.max_prefill_tokens:
                break
            longest = max(longest, self._final_length(seq))
            if (
                self.max_total_tokens
                and rows + len(out)
                and (rows + len(out) + 1) * longest > self.max_total_tokens
            ):
                break
            tokens += size
            out.append(self._waiting.popleft())
            if not seq.output_ids and seq is seq.job.sequences[0]:
                self._queued_jobs -= 1
        return out

    def _apply_aborts(self, aborts: list[tuple[str | None, str]]) -> None:
        def matches(seq: Sequence) -> str | None:
            for rid, message in aborts:
                if rid is None or rid in (seq.id, seq.job.rid):
                    return message
            return None

        with self._cond:
            waiting = list(self._waiting)
            self._waiting = deque(s for s in waiting if matches(s) is None)
            for seq in waiting:
                if matches(seq) is not None and not seq.output_ids and seq is seq.job.sequences[0]:
                    self._queued_jobs -= 1
        for seq in [*waiting, *self._running]:
            message = matches(seq)
            if message is not None:
                self._finish(seq, abort_reason(message))
        self._drop_finished()

    def _admit(self, seqs: list[Sequence]) -> None:
        """Prefill new (or retracted) sequences; samples that share a prompt share one prefill.
        Prompt-token logprobs are computed here for sequences that asked for them."""
        unique: dict[tuple[tuple[int, ...], Score | None], int] = {}
        rows: list[int] = []
        for seq in seqs:
            key = ((*seq.prompt, *seq.output_ids), _score_spec(seq))
            if key in unique:
                seq.cached_tokens = len(seq.prompt)
            rows.append(unique.setdefault(key, len(unique)))
        score = [spec for _tokens, spec in unique]
        cacheable = [False] * len(unique)
        for seq, row in zip(seqs, rows, strict=True):
            cacheable[row] = cacheable[row] or not seq.output_ids
        (logits, cache, scores), hits = self.prompt_cache.prefill(
            self.runner, [list(t) for t, _ in unique], score, cacheable
        )
        self.stats["forward_passes"] += not all(hits)
        for seq, row in zip(seqs, rows, strict=True):
            if hits[row]:
                seq.cached_tokens = len(seq.prompt)
            if score[row] is not None and seq.input_logprobs is None:
                seq.input_logprobs = scores[row]
            if seq.params.max_new_tokens == 0:  # prefill only (scoring a prompt)
                self._finish(seq, {"type": "length", "length": 0})
        keep = [i for i, seq in enumerate(seqs) if not seq.done]
        if not keep:
            return
        if [rows[i] for i in keep] != list(range(len(unique))):
            index = torch.tensor([rows[i] for i in keep], device=cache.lengths.device)
            logits, cache = logits.index_select(0, index), cache.select(index)
        seqs = [seqs[i] for i in keep]
        for seq in seqs:
            seq.weight_version = self.weight_version
        self._running.extend(seqs)
        self._cache = cache if self._cache is None else KVCache.concat([self._cache, cache])
        self._sample_and_advance(logits, len(self._running) - len(seqs))

    def _decode_step(self) -> None:
        assert self._cache is not None
        last = torch.tensor([s.output_ids[-1] for s in self._running])
        logits = self.runner.decode(self._cache, last)
        self.stats["forward_passes"] += 1
        self._sample_and_advance(logits, 0)

    def _sample_and_advance(self, logits: torch.Tensor, first: int) -> None:
        """Sample a token for running rows `first:` from `logits` (one row each), append it and
        end the sequences that are done."""
        seqs = self._running[first:]
        eos = self.runner.eos_token_ids
        banned = [
            sorted((set() if s.params.ignore_eos else eos) | set(s.params.stop_token_ids))
            if len(s.output_ids) < s.params.min_new_tokens
            else []
            for s in seqs
        ]
        rows = row_params(
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [len(s.output_ids) for s in seqs],
            banned,
            logits.shape[1],
        )
        top_n = max(s.top_logprobs_num for s in seqs)
        tokens, logprobs, top = sample(logits, rows, top_n)
        top_lists = (top[0].tolist(), top[1].tolist()) if top is not None else None
        for i, (seq, token, logprob) in enumerate(
            zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            if top_lists is not None and seq.top_logprobs_num:
                n = seq.top_logprobs_num
                seq.top_logprobs.append(
                    list(zip(top_lists[0][i][:n], top_lists[1][i][:n], strict=True))
                )
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
        self.stats["generated_tokens"] += len(seqs)
        for job in {id(s.job): s.job for s in seqs if s.job.stream and not s.job.done}.values():
            job.notify(job, False)
        self._drop_finished()

    def _stop_reason(self, seq: Sequence, token: int) -> dict[str, Any] | None:
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.runner.eos_token_ids
        ):
            return {"type": "stop", "matched": token}
        if params.stop:
            tail = self.runner.stop_tokenizer.decode(
                seq.output_ids[-64:], skip_special_tokens=False
            )
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        count = len(seq.output_ids)
        if count >= params.max_new_tokens or len(seq.prompt) + count >= self.context_length:
            return {"type": "length", "length": count}
        return None

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        if seq.done:
            return
        if seq.return_routed_experts and self._cache is not None:
            row = next((i for i, s in enumerate(self._running) if s is seq), None)
            if row is not None:  # a running row: its cache holds every position's routing
                seq.routed_experts = self._cache.routed_experts(row)
        seq.finish_reason = reason
        seq.weight_version = self.weight_version
        if seq.job.done:
            seq.job.notify(seq.job, True)

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self._running) if not s.done]
        if len(keep) == len(self._running):
            return
        with self._cond:
            self._running = [self._running[i] for i in keep]
            if not keep:
                self._cache = None
            elif self._cache is not None:
                index = torch.tensor(keep, device=self._cache.lengths.device)
                self._cache = self._cache.select(index)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            seqs = [*self._running, *self._waiting]
            self._running, self._waiting, self._cache = [], deque(), None
            self._queued_jobs = 0
            commands, self._commands = list(self._commands), deque()
        for seq in seqs:
            self._finish(seq, abort_reason(message))
        for command in commands:
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(RuntimeError(message))


def _score_spec(seq: Sequence) -> Score | None:
    """(start, temperature) if this sequence still needs its prompt-token logprobs."""
    if seq.input_logprob_start is None or seq.input_logprobs is not None:
        return None
    return seq.input_logprob_start, 1.0 if seq.params.greedy else seq.params.temperature


def abort_reason(message: str) -> dict[str, Any]:
    """SGLang's FINISH_ABORT.to_json()."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


_ids = itertools.count()


def new_rid() -> str:
    """A process-unique request id (SGLang uses uuid hex; any unique string works)."""
    return f"{time.time_ns():x}{next(_ids):06x}"
