"""Checks of one stream entry before it may reach a batch: pure logic over its raw fields.

`check_entry` answers a `SampleGroup` fit to train, or a `Rejected` naming the
`DeadLetterReason`: not a SampleGroup, another schema version, a required field absent or empty,
a token id outside the vocabulary, per-token arrays of different lengths, a sample longer than
the model's context (or the micro-batch token budget) or a response beyond --max-response-len, a
non-finite reward, a weight version the trainer has not published, or one from before this
lineage's first version (`--new-lineage`). Knows nothing of Redis or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from proto import SampleGroup
from proto.drops import DeadLetterReason
from proto.messages import SCHEMA_VERSION


@dataclass(frozen=True)
class Limits:
    """What a sample may hold: token ids < `vocab_size`, prompt + response <= `max_tokens`,
    response <= `max_response_len`."""

    vocab_size: int
    max_tokens: int
    max_response_len: int


@dataclass(frozen=True)
class Rejected:
    """Why an entry is not trained; `samples` counts them where the entry decoded (else 0)."""

    reason: DeadLetterReason
    detail: str
    group_id: str = ""
    samples: int = 0
    weight_version: int = -1


_decoder = msgspec.msgpack.Decoder(SampleGroup)


def check_entry(
    fields: dict[bytes, bytes], limits: Limits, version: int, lineage_floor: int = 0
) -> SampleGroup | Rejected:
    """`fields` as read from the stream; `version` = the trainer's latest published version;
    a group stamped below `lineage_floor` was made by weights of another lineage."""
    payload = fields.get(b"d")
    if payload is None:
        names = sorted(k.decode(errors="replace") for k in fields)
        return Rejected(DeadLetterReason.UNDECODABLE, f"no payload field 'd' (fields: {names})")
    try:
        group = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        return _classify(payload, exc)
    if group.schema_version != SCHEMA_VERSION:
        return _schema(group.schema_version)
    return _check_group(group, limits, version, lineage_floor)


def _schema(seen: object) -> Rejected:
    return Rejected(
        DeadLetterReason.SCHEMA_VERSION,
        f"schema_version {seen}; this trainer speaks {SCHEMA_VERSION}: run the same Tandem "
        "version in every service",
    )


def _classify(payload: bytes, exc: msgspec.DecodeError) -> Rejected:
    """A payload that is no SampleGroup: another schema version, a missing field, or garbage."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return Rejected(DeadLetterReason.UNDECODABLE, f"not msgpack ({len(payload)} bytes): {exc}")
    if isinstance(raw, dict):
        seen = raw.get("schema_version", SCHEMA_VERSION)
        if seen != SCHEMA_VERSION:
            return _schema(seen)
        if "missing required field" in str(exc):
            return Rejected(DeadLetterReason.MISSING_FIELD, str(exc), str(raw.get("group_id", "")))
    return Rejected(DeadLetterReason.UNDECODABLE, f"not a SampleGroup: {exc}")


def _check_group(
    group: SampleGroup, limits: Limits, version: int, lineage_floor: int
) -> SampleGroup | Rejected:
    def reject(reason: DeadLetterReason, detail: str) -> Rejected:
        return Rejected(reason, detail, group.group_id, len(group.samples), group.weight_version)

    if not group.group_id or not group.samples:
        return reject(DeadLetterReason.MISSING_FIELD, "empty group_id or no samples")
    stamps = [group.weight_version]
    for i, s in enumerate(group.samples):
        where = f"sample {i}"
        if not s.prompt_ids:
            return reject(DeadLetterReason.MISSING_FIELD, f"{where}: empty prompt_ids")
        if not math.isfinite(s.reward):
            return reject(DeadLetterReason.NONFINITE_REWARD, f"{where}: reward {s.reward}")
        n = len(s.response_ids)
        lengths = {
            "response_logprobs": len(s.response_logprobs),
            "loss_mask": len(s.loss_mask) or n,  # empty = every token trains
            "token_versions": len(s.token_versions) or n,  # empty = all `weight_version`
        }
        wrong = {k: v for k, v in lengths.items() if v != n}
        if wrong:
            detail = f"{where}: {n} response_ids but {wrong}"
            return reject(DeadLetterReason.LENGTH_MISMATCH, detail)
        total = len(s.prompt_ids) + n
        if total > limits.max_tokens or n > limits.max_response_len:
            detail = (
                f"{where}: {len(s.prompt_ids)} prompt + {n} response tokens; the trainer takes "
                f"at most {limits.max_tokens} in all and {limits.max_response_len} of response "
                "(the model's context or --max-tokens-per-gpu; --max-response-len)"
            )
            return reject(DeadLetterReason.TOO_LONG, detail)
        ids = (s.prompt_ids, s.response_ids) if n else (s.prompt_ids,)
        low, high = min(min(i) for i in ids), max(max(i) for i in ids)  # C loops: fast
        if low < 0 or high >= limits.vocab_size:
            token = low if low < 0 else high
            detail = f"{where}: token id {token} outside the vocabulary [0, {limits.vocab_size})"
            return reject(DeadLetterReason.TOKEN_OUT_OF_VOCAB, detail)
        stamps += [s.weight_version, *s.token_versions]
    if max(stamps) > version:
        detail = f"weight version {max(stamps)}; the trainer has published up to {version}"
        return reject(DeadLetterReason.FUTURE_VERSION, detail)
    if lineage_floor and min(stamps) < lineage_floor:
        detail = (
            f"weight version {min(stamps)}, made before this lineage's first version "
            f"{lineage_floor} (--new-lineage)"
        )
        return reject(DeadLetterReason.FOREIGN_LINEAGE, detail)
    return group
