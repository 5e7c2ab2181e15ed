"""Checks of one stream entry before it may reach a batch: pure logic over its raw fields.

An entry holds one group or several (proto/packed.py). `decode_entry` answers its groups by
key (`entry/index`), or a `Rejected` for the whole entry when it decodes to none: not packed
groups nor a SampleGroup, no payload, another schema version. `check_group` answers the group
fit to train, or a `Rejected` naming the `DeadLetterReason`: another schema version, a required field absent or empty,
a token id outside the vocabulary, per-token arrays of different lengths, a sample longer than
the model's context (or the micro-batch token budget) or a response beyond --max-response-len, a
non-finite reward, a temperature that is not a finite number > 0, a weight version the trainer has not published, or one from before this
lineage's first version (`--new-lineage`). `check_groups` checks the groups of an entry in one
pass (the token ids and versions of the whole entry in one numpy array each: ~2 µs a 4 KB group,
~16 one by one) and each group alone only when one may fail, for its reason. Knows nothing of
Redis or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from proto.contract import SampleLimits
from proto.drops import DeadLetterReason
from proto.messages import SCHEMA_VERSION
from proto.packed import AnySample, Group, PackedGroup, PackedSample, groups_of


@dataclass(frozen=True)
class Limits:
    """What a sample may hold: token ids < `vocab_size`, prompt + response <= `max_tokens`,
    response <= `max_response_len`."""

    vocab_size: int
    max_tokens: int
    max_response_len: int

    def stated(self) -> SampleLimits:
        """What the run is told (the router cuts episodes and holds PATCHes to it)."""
        return SampleLimits(max_tokens=self.max_tokens, max_response_len=self.max_response_len)


def limits_of(model: str, max_tokens_per_gpu: int, max_response_len: int) -> Limits:
    """What a sample may hold: the vocabulary and context of the HF `model` directory, the token
    budget of a micro-batch (its inputs are all tokens but the last), and --max-response-len."""
    from proto.models import read_config

    hf_cfg, _ = read_config(model)
    text = hf_cfg.get("text_config") or hf_cfg
    context = int(text.get("max_position_embeddings", 4096))
    return Limits(
        vocab_size=int(text["vocab_size"]),
        max_tokens=min(context, max_tokens_per_gpu + 1),
        max_response_len=max_response_len,
    )


@dataclass(frozen=True)
class Rejected:
    """Why an entry is not trained; `samples` counts them where the entry decoded (else 0)."""

    reason: DeadLetterReason
    detail: str
    group_id: str = ""
    samples: int = 0
    weight_version: int = -1
    count: int = 1  # groups (those of a foreign entry that decoded)


def foreign(groups: list[tuple[str, Group]] | Rejected) -> Rejected:
    """Why an entry no ledger PUT wrote (no field `n`) is not trained, whatever it holds: the
    run never counted it put (the router's demand gate would count it consumed), nor drew
    its prompts."""
    decoded = [] if isinstance(groups, Rejected) else [group for _, group in groups]
    return Rejected(
        DeadLetterReason.FOREIGN_ENTRY,
        f"written to the samples stream outside the router's path (no field 'n' of the ledger's "
        f"PUT); {len(decoded)} groups decoded"
        + (f" ({groups.reason}: {groups.detail[:200]})" if isinstance(groups, Rejected) else ""),
        samples=sum(len(group.samples) for group in decoded),
        count=max(len(decoded), 1),
    )


def decode_groups(entry_id: str, fields: dict[bytes, bytes]) -> list[tuple[str, Group]] | Rejected:
    """The groups of an entry as read from the stream, by key (`entry/index`)."""
    payload = fields.get(b"d")
    if payload is None:
        names = sorted(k.decode(errors="replace") for k in fields)
        return Rejected(DeadLetterReason.UNDECODABLE, f"no payload field 'd' (fields: {names})")
    try:
        groups = groups_of(entry_id, payload)
    except msgspec.DecodeError as exc:
        return _classify(payload, exc)
    return groups or Rejected(DeadLetterReason.MISSING_FIELD, "an entry of no group")


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


def _lengths(s: AnySample) -> tuple[int, int, int, int, int]:
    """Lengths of (prompt_ids, response_ids, response_logprobs, loss_mask, token_versions);
    ValueError when a packed array is not whole values."""
    if not isinstance(s, PackedSample):
        return (
            len(s.prompt_ids),
            len(s.response_ids),
            len(s.response_logprobs),
            len(s.loss_mask),
            len(s.token_versions),
        )
    if (len(s.prompt) | len(s.response) | len(s.logprobs) | len(s.versions)) & 3:
        sizes = [len(b) for b in (s.prompt, s.response, s.logprobs, s.versions)]
        raise ValueError(f"packed arrays of {sizes} bytes, not whole 4-byte values")
    return (
        len(s.prompt) // 4,
        len(s.response) // 4,
        len(s.logprobs) // 4,
        len(s.mask),
        len(s.versions) // 4,
    )


def _ids_in(s: AnySample, vocab_size: int) -> str:
    """'' when every token id of the sample is in [0, vocab_size), else the first one outside."""
    if isinstance(s, PackedSample):
        ids = np.frombuffer(s.prompt + s.response, "<i4")
        low, high = int(ids.min()), int(ids.max())
    else:
        both = (s.prompt_ids, s.response_ids) if s.response_ids else (s.prompt_ids,)
        low, high = min(min(i) for i in both), max(max(i) for i in both)  # C loops: fast
    if low < 0 or high >= vocab_size:
        return f"token id {low if low < 0 else high} outside the vocabulary [0, {vocab_size})"
    return ""


def _in(arrays: list[bytes], low: int, high: int) -> bool:
    """Every int32 of `arrays` (whole 4-byte values) in [low, high]."""
    values = np.frombuffer(b"".join(arrays), "<i4")
    return not len(values) or (int(values.min()) >= low and int(values.max()) <= high)


def _all_fine(groups: Sequence[Group], limits: Limits, version: int, lineage_floor: int) -> bool:
    """Every group packed and fit to train: `check_group`'s checks in one pass over the whole
    entry (the common case). False when any may fail: `check_group` then names the fault."""
    ids: list[bytes] = []
    versions: list[bytes] = []
    stamps: list[int] = []
    max_bytes, max_response = 4 * limits.max_tokens, 4 * limits.max_response_len
    finite = math.isfinite
    for group in groups:  # (one `if` a sample, not five: this loop is the intake's hot path)
        if (
            type(group) is not PackedGroup
            or group.schema_version != SCHEMA_VERSION
            or not group.group_id
            or not group.samples
        ):
            return False
        stamps.append(group.weight_version)
        prompt = None
        for s in group.samples:
            n, p, v, m = len(s.response), len(s.prompt), len(s.versions), len(s.mask)
            if (
                not p
                or (p | n | v) & 3
                or len(s.logprobs) != n
                or (v and v != n)
                or (m and m != n >> 2)
                or p + n > max_bytes
                or n > max_response
                or not finite(s.reward)
                or not 0.0 < s.temperature < math.inf
            ):
                return False
            stamps.append(s.weight_version)
            if s.prompt != prompt:
                prompt = s.prompt
                ids.append(prompt)
            ids.append(s.response)
            if v:
                versions.append(s.versions)
    low = lineage_floor if lineage_floor else -(1 << 31)
    if not low <= min(stamps) <= max(stamps) <= version:
        return False
    return _in(ids, 0, limits.vocab_size - 1) and _in(versions, low, version)


def check_groups(
    groups: Sequence[Group], limits: Limits, version: int, lineage_floor: int = 0
) -> list[Group | Rejected]:
    """`check_group` of each of `groups` (an entry's), the whole entry checked at once first."""
    if not groups or _all_fine(groups, limits, version, lineage_floor):
        return list(groups)
    return [check_group(group, limits, version, lineage_floor) for group in groups]


def _check_sample(s: AnySample, limits: Limits) -> tuple[DeadLetterReason, str] | None:
    """Why one sample must not be trained (None: it may)."""
    try:
        p, n, logprobs, mask, versions = _lengths(s)
    except ValueError as exc:
        return DeadLetterReason.UNDECODABLE, str(exc)
    if not p:
        return DeadLetterReason.MISSING_FIELD, "empty prompt_ids"
    if not math.isfinite(s.reward):
        return DeadLetterReason.NONFINITE_REWARD, f"reward {s.reward}"
    if not 0.0 < s.temperature < math.inf:  # (the trainer divides the logits by it)
        return DeadLetterReason.BAD_TEMPERATURE, f"temperature {s.temperature}"
    if logprobs != n or mask not in (0, n) or versions not in (0, n):  # empty: see Sample
        lengths = {"response_logprobs": logprobs, "loss_mask": mask, "token_versions": versions}
        wrong = {k: v for k, v in lengths.items() if v != n and (v or k == "response_logprobs")}
        return DeadLetterReason.LENGTH_MISMATCH, f"{n} response_ids but {wrong}"
    if p + n > limits.max_tokens or n > limits.max_response_len:
        return DeadLetterReason.TOO_LONG, (
            f"{p} prompt + {n} response tokens; the trainer takes at most {limits.max_tokens} "
            f"in all and {limits.max_response_len} of response (the model's context or "
            "--max-tokens-per-gpu; --max-response-len)"
        )
    outside = _ids_in(s, limits.vocab_size)
    return (DeadLetterReason.TOKEN_OUT_OF_VOCAB, outside) if outside else None


def check_group(
    group: Group, limits: Limits, version: int, lineage_floor: int = 0
) -> Group | Rejected:
    """`group` if fit to train; `version` = the trainer's latest published version; a group
    stamped below `lineage_floor` was made by weights of another lineage."""
    if group.schema_version != SCHEMA_VERSION:
        return _schema(group.schema_version)

    def reject(reason: DeadLetterReason, detail: str) -> Rejected:
        return Rejected(reason, detail, group.group_id, len(group.samples), group.weight_version)

    if not group.group_id or not group.samples:
        return reject(DeadLetterReason.MISSING_FIELD, "empty group_id or no samples")
    stamps = [group.weight_version]
    samples: Sequence[AnySample] = group.samples
    for i, s in enumerate(samples):
        why = _check_sample(s, limits)
        if why is not None:
            return reject(why[0], f"sample {i}: {why[1]}")
        stamps.append(s.weight_version)
        if isinstance(s, PackedSample) and not s.versions:
            continue
        stamps += s.token_versions
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
