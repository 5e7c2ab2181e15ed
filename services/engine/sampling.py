"""Sampling parameters (SGLang's names and defaults) and the batched, per-row sampler.

Every row draws its randomness from its own counter-based stream: the uniform for output
position t of a row is a hash of (row seed, t). So a row's tokens depend only on its own seed and
its own logits, never on which other rows share the batch or in what order.

Tokens are drawn from logits / temperature, filtered by top-k / top-p / min-p and renormalized
over the kept tokens. Reported logprobs are SGLang's default: `log_softmax(logits / temperature)`
before any filter (not renormalized over the kept tokens), so the two engines report the same
numbers for the same logits. Greedy rows (temperature 0) report `log_softmax(logits)`. At
temperature 1 this is exactly the teacher-forced `log_softmax` of the model, filter or not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)

# SGLang parameters we accept only at their neutral value (anything else is refused with 400,
# rather than silently ignored, so a client never gets a distribution it did not ask for).
NEUTRAL_PARAMS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stop_regex": None,
}
# Accepted and ignored: they only shape text formatting or streaming cadence here.
IGNORED_PARAMS = {"spaces_between_special_tokens", "stream_interval", "watermark"}


MAX_N = 1024  # parallel samples per prompt: bounds what one request can queue


class RequestError(ValueError):
    """A malformed request; the message names the field. Answered with HTTP 400."""


@dataclass
class SamplingParams:
    """One sequence's sampling parameters, SGLang names and defaults."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_json(cls, raw: Any) -> SamplingParams:
        """Parse and validate `sampling_params`; raise `RequestError` naming the bad field."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise RequestError("sampling_params must be an object")
        params = cls()
        known = {f.name for f in fields(cls)}
        for key, value in raw.items():
            if key in known:
                if value is not None:
                    setattr(params, key, _coerce(key, value, getattr(cls(), key)))
            elif key in NEUTRAL_PARAMS:
                if value is not None and value != NEUTRAL_PARAMS[key]:
                    raise RequestError(
                        f"sampling_params.{key}={value!r} is not supported by the reference engine"
                    )
            elif key not in IGNORED_PARAMS:
                raise RequestError(f"sampling_params.{key} is not a known sampling parameter")
        params._check()
        return params

    def _check(self) -> None:
        def bad(name: str, why: str) -> RequestError:
            return RequestError(f"sampling_params.{name}={getattr(self, name)!r}: {why}")

        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", "must be between 0 and max_new_tokens")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "must be -1 (all) or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be between 1 and {MAX_N}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        # SGLang treats very small temperatures (and top_k == 1) as greedy
        return self.temperature < 1e-5 or self.top_k == 1


def _coerce(key: str, value: Any, default: Any) -> Any:
    if key == "stop":
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise RequestError("sampling_params.stop must be a string or a list of strings")
        return value
    if key == "stop_token_ids":
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise RequestError("sampling_params.stop_token_ids must be a list of integers")
        return [int(v) for v in value]
    if key == "sampling_seed" or (isinstance(default, int) and not isinstance(default, bool)):
        if not _is_int(value):
            raise RequestError(f"sampling_params.{key} must be an integer, got {value!r}")
        return int(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise RequestError(f"sampling_params.{key} must be true or false, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestError(f"sampling_params.{key} must be a number, got {value!r}")
        return float(value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- per-row random streams --------------------------------------------------------------


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, vectorized (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def derive_seed(sampling_seed: int | None, index: int) -> int:
    """Seed of parallel sample `index` (of `n`) from the request's `sampling_seed`; a random
    one when the request gave none."""
    if sampling_seed is None:
        return random.getrandbits(64)
    base = np.array([sampling_seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    return int(_mix(_mix(base) ^ np.uint64(index))[0])


def uniforms(seeds: np.ndarray, steps: np.ndarray) -> torch.Tensor:
    """Uniform [0, 1) numbers, one per row, from (seed, step) alone."""
    bits = _mix(_mix(seeds.astype(np.uint64)) ^ steps.astype(np.uint64))
    return torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * 2.0**-53)


# ---- the batched sampler -----------------------------------------------------------------


@dataclass
class RowParams:
    """The per-row tensors the sampler needs, built once per decode step."""

    temperature: torch.Tensor  # [rows], 1.0 for greedy rows (their logprobs are unscaled)
    greedy: torch.Tensor  # [rows] bool
    top_p: torch.Tensor
    top_k: torch.Tensor  # [rows] long, vocab size when unlimited
    min_p: torch.Tensor
    seeds: np.ndarray  # [rows] uint64
    steps: np.ndarray  # [rows] output position being sampled
    banned: list[list[int]]  # per row: token ids masked out (min_new_tokens not reached)
    needs_filter: bool


def row_params(
    params: list[SamplingParams],
    seeds: list[int],
    steps: list[int],
    banned: list[list[int]],
    vocab: int,
) -> RowParams:
    greedy = [p.greedy for p in params]
    return RowParams(
        temperature=torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        ),
        greedy=torch.tensor(greedy),
        top_p=torch.tensor([p.top_p for p in params]),
        top_k=torch.tensor([vocab if p.top_k < 0 else min(p.top_k, vocab) for p in params]),
        min_p=torch.tensor([p.min_p for p in params]),
        seeds=np.array(seeds, dtype=np.uint64),
        steps=np.array(steps, dtype=np.uint64),
        banned=banned,
        needs_filter=any(
            not g and (p.top_p < 1 or p.top_k > 0 or p.min_p > 0)
            for p, g in zip(params, greedy, strict=True)
        ),
    )


def sample(
    logits: torch.Tensor, rows: RowParams, top_n: int = 0
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Pick one token per row; return `(tokens, logprobs, top)`: the logprob of each picked
    token under logits / temperature (before top-k/top-p/min-p, as SGLang reports it) and, if
    `top_n`, the `top_n` most likely tokens of that distribution `(logprobs, ids)`. `logits` is `[rows, vocab]`, any device."""
    logits = logits.float()
    device = logits.device
    if any(rows.banned):
        logits = logits.clone()
        for r, ids in enumerate(rows.banned):
            if ids and len(ids) < logits.shape[1]:  # banning every token would leave nothing
                logits[r, ids] = float("-inf")
    scaled = logits / rows.temperature.to(device)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)  # reported: unfiltered, as SGLang does
    kept = torch.log_softmax(_filter(scaled, rows), dim=-1) if rows.needs_filter else logprobs
    cdf = kept.exp().double().cumsum(-1)
    u = uniforms(rows.seeds, rows.steps).to(device)[:, None] * cdf[:, -1:]
    sampled = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=logits.shape[1] - 1)
    tokens = torch.where(rows.greedy.to(device), logits.argmax(-1), sampled)
    top = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1) if top_n else None
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    if top is not None:
        top = (top.values.cpu(), top.indices.cpu())
    return tokens.cpu(), chosen.cpu(), top


def _filter(scaled: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / top-p / min-p set."""
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    device = scaled.device
    ranks = torch.arange(scaled.shape[1], device=device)[None, :]
    drop = ranks >= rows.top_k.to(device)[:, None]
    drop |= (sorted_probs.cumsum(-1) - sorted_probs) > rows.top_p.to(device)[:, None]
    drop |= sorted_probs < rows.min_p.to(device)[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False  # the most likely token always stays
    drop_original = torch.zeros_like(drop).scatter_(1, order, drop)
    return scaled.masked_fill(drop_original, float("-inf"))
