"""What the services of one run tell each other through Redis besides samples: the longest
sample the trainer takes (`SampleLimits`) and what each service is doing (`ServiceStatus`).
The run contract (the terms they must agree on) is `proto.run_terms`; its names are
re-exported here for the code that checks it in Redis.
"""

from __future__ import annotations

import msgspec

from proto.run_terms import FLAGS, ContractMismatchError, RunContract, mismatch, model_identity

__all__ = ["FLAGS", "ContractMismatchError", "RunContract", "SampleLimits", "ServiceStatus"]
__all__ += ["mismatch", "model_identity"]


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
