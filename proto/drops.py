"""Why a group or a sample will not be trained on: the one list every drop site names.

`DropRecord.reason` (proto.messages) takes a `DropReason` value; the ledger counts drops per
reason, in groups and in samples. `DeadLetterReason` refines `DropReason.DEAD_LETTERED`: an entry
the trainer could not decode or must not train is moved to the dead-letter stream with one of
these, and never crashes the trainer.
"""

from __future__ import annotations

from enum import StrEnum


class DropReason(StrEnum):
    """A dropped group's or sample's fate; the value is its counter name."""

    STALE = "stale"  # trainer: older than max_staleness versions behind it
    CANCELLED = "cancelled"  # router: stopped with the group in flight (or a session open)
    SESSION_EXPIRED = "session_expired"  # router: an agent session ended without a reward
    REDIS_UNAVAILABLE = "redis_unavailable"  # router: the buffer could not take the group
    ENGINE_ERROR = "engine_error"  # router: no engine answered its requests (drawn again once)
    ENV_ERROR = "env_error"  # router: an environment episode failed
    ENV_TIMEOUT = "env_timeout"  # router: an environment episode ran past its timeout
    ENV_ALL_FAILED = "env_all_failed"  # router: every episode of a group failed
    REWARD_ERROR = "reward_error"  # router: the reward function raised or returned None
    REWARD_NONFINITE = "reward_nonfinite"  # router: the reward was NaN or infinite
    ABORTED = "aborted"  # router: a generation stayed aborted after its retries
    PROMPT_TOO_LONG = "prompt_too_long"  # router: the prompt leaves the model no position
    ALL_REWARDS_EQUAL = "all_rewards_equal"  # router: dynamic sampling, no GRPO signal
    FILTERED = "filtered"  # router or trainer: removed by another filter
    DEAD_LETTERED = "dead_lettered"  # trainer: a bad entry, moved to the dead-letter stream
    SKIPPED_UPDATE = "skipped_update"  # trainer: its step's update was skipped (non-finite)


class DeadLetterReason(StrEnum):
    """Why the trainer moved an entry to the dead-letter stream instead of training it."""

    UNDECODABLE = "undecodable"  # not a SampleGroup (garbage bytes, missing payload)
    SCHEMA_VERSION = "schema_version"  # a schema version this trainer does not know
    MISSING_FIELD = "missing_field"  # a required field is absent or empty
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"  # a token id outside the model's vocabulary
    LENGTH_MISMATCH = "length_mismatch"  # per-token arrays of different lengths
    TOO_LONG = "too_long"  # beyond the context or the response-length bound
    NONFINITE_REWARD = "nonfinite_reward"  # a NaN or infinite reward
    BAD_TEMPERATURE = "bad_temperature"  # a sample's temperature not a finite number > 0
    FUTURE_VERSION = "future_version"  # stamped with a version the trainer has not published
    FOREIGN_LINEAGE = "foreign_lineage"  # produced by another run's or lineage's weights
    FOREIGN_ENTRY = "foreign_entry"  # written to the stream outside the router's (no ledger PUT)
