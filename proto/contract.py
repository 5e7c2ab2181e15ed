"""The run contract: the quantities that router, trainer and broker of one run must agree on.

Written once per run to Redis (`SampleBuffer.agree_contract`) by the first service that starts,
field by field, and checked by every other at start-up. A service states only the terms it
knows (None = "not mine to say"); a term another service stated differently is a
`ContractMismatchError` naming both values, who set the first one, and the flag to change.
The terms cannot change while the run lives: `PATCH /rollout/config` refuses them with 409.

Who states what: the router and the trainer state the batch arithmetic, `max_staleness` and
the model; the trainer and the broker state `weight_transport`. `tandem up` passes every child
the same values and refuses, before anything starts, a pass-through flag that contradicts one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

# Term -> the command-line flag that sets it (the same name in every service).
FLAGS = {
    "model_id": "--model",
    "rollout_batch_size": "--rollout-batch-size",
    "n_samples_per_prompt": "--n-samples-per-prompt",
    "num_steps_per_rollout": "--num-steps-per-rollout",
    "max_staleness": "--max-staleness",
    "weight_transport": "--weight-transport (the broker's --transport)",
}


class ContractMismatchError(ValueError):
    """This service's terms contradict the run's; the message says what to change."""


class RunContract(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One service's statement of the run's terms; None = this service does not set it.

    Sent by router, trainer and broker into Redis (hash `tandem:{run_id}:contract`, one field
    per term, JSON values); read back by each of them and by `tandem up`.
    `model_id` is `model_identity(--model)`: the same checkpoint under different paths (a
    container mount, another host) is the same model."""

    model_id: str | None = None
    rollout_batch_size: int | None = None
    n_samples_per_prompt: int | None = None
    num_steps_per_rollout: int | None = None
    max_staleness: int | None = None
    weight_transport: str | None = None

    def terms(self) -> dict[str, object]:
        """The terms this service states."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    @property
    def global_batch_samples(self) -> int | None:
        """Samples per optimizer step, when the batch terms are known."""
        if None in (self.rollout_batch_size, self.n_samples_per_prompt, self.num_steps_per_rollout):
            return None
        assert self.rollout_batch_size and self.n_samples_per_prompt and self.num_steps_per_rollout
        return self.rollout_batch_size * self.n_samples_per_prompt // self.num_steps_per_rollout


class SampleLimits(msgspec.Struct, kw_only=True):
    """The longest sample the trainer takes: `max_tokens` of prompt and response (the model's
    context or --max-tokens-per-gpu + 1) and `max_response_len` of response (--max-response-len);
    a longer one is dead-lettered, never trained. Written by the trainer at its start into Redis
    (`tandem:{run_id}:limits`); the router refuses a `PATCH /rollout/config` that would make
    longer samples."""

    max_tokens: int
    max_response_len: int


class ServiceStatus(msgspec.Struct, kw_only=True):
    """What one service is doing now, and what it waits for (empty when it is not waiting).

    Sent by router, trainer and broker into Redis (`tandem:{run_id}:status:{role}`, refreshed
    at least every few seconds while the service lives) and served at each one's status route;
    read by `tandem up`'s progress watchdog, which prints `waiting_for` of every service when no
    step has completed for a while. `waiting_for` is a sentence a user can act on, e.g. "engines
    on weight version >= 71 (they serve 0): is the broker syncing them?"; `since` is when that
    wait began (unix seconds); `detail` holds the numbers behind it, and `note` there a sentence
    the watchdog prints too (the router's: groups dropped since the last one put, and why)."""

    role: str
    state: str
    waiting_for: str = ""
    since: float = 0.0
    error: str = ""
    detail: dict[str, float | int | str] = {}
    updated_at: float = 0.0
    pid: int = 0


def model_identity(model_dir: str | Path) -> str:
    """`model_type` and a short hash of the HF directory's `config.json`."""
    path = Path(model_dir) / "config.json"
    raw = path.read_bytes()
    model_type = msgspec.json.decode(raw).get("model_type", "?")
    return f"{model_type}:{hashlib.sha256(raw).hexdigest()[:12]}"


def mismatch(term: str, stored: object, by: str, mine: object, who: str) -> str:
    """The one-line explanation of a contradicted term."""
    return (
        f"run contract: {term} is {stored!r} in this run (set by the {by}) but this {who} "
        f"was started with {mine!r}; start every service of the run with the same "
        f"{FLAGS.get(term, term)}, or use another --run-id for a new run"
    )
