"""Sample groups as the buffer stores them: per-token arrays packed as bytes, several groups to
a stream entry.

A `SampleGroup` of Python lists costs ~15 ns per token to decode (one object per id and
log-prob); a `PackedGroup` holds each per-token array as one `bytes` (token ids and versions
int32, log-probs float32, the loss mask uint8; little-endian), so decoding it is a copy. Its samples answer `prompt_ids`,
`response_ids`, `response_logprobs`, `loss_mask` and `token_versions` as `array.array`s, read-only
views with `len`, indexing, `min`/`max` and `tolist()`, so code that reads a `Sample` reads a
`PackedSample` the same way. The trainer computes in float32, so packed log-probs lose nothing it
uses.

A stream entry's `d` is the msgpack of `list[PackedGroup]` (the router's group commit: every
group of one write); `decode_entry` also takes one `SampleGroup` (a map), as any producer may
still write it.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import msgspec

from proto.messages import SCHEMA_VERSION, Sample, SampleGroup

IDS, LOGPROBS, MASK = "i", "f", "B"  # array and struct typecodes: int32, float32, uint8
_SWAP = sys.byteorder != "little"  # arrays are in the host's order, the stream's is little


def _array(typecode: str, raw: bytes) -> array:
    out = array(typecode)
    out.frombytes(raw)
    if _SWAP:
        out.byteswap()
    return out


class PackedSample(msgspec.Struct, array_like=True, frozen=True):
    """A `Sample` with its per-token arrays as bytes (`pack`); empty `mask` = every response
    token trains, empty `versions` = every token is `weight_version`'s. `temperature` is last
    with a default: an entry written without it reads as 1, and a reader that predates it skips
    it."""

    prompt: bytes
    response: bytes
    logprobs: bytes
    mask: bytes
    versions: bytes
    reward: float
    weight_version: int
    finish_reason: str
    response_text: str
    routed_experts: bytes
    temperature: float = 1.0

    @property
    def prompt_ids(self) -> array:
        return _array(IDS, self.prompt)

    @property
    def response_ids(self) -> array:
        return _array(IDS, self.response)

    @property
    def response_logprobs(self) -> array:
        return _array(LOGPROBS, self.logprobs)

    @property
    def loss_mask(self) -> array:
        return _array(MASK, self.mask)

    @property
    def token_versions(self) -> array:
        return _array(IDS, self.versions)


class PackedGroup(msgspec.Struct, array_like=True, frozen=True):
    """A `SampleGroup` whose samples are packed."""

    group_id: str
    prompt: str
    label: str
    samples: list[PackedSample]
    weight_version: int
    created_at: float
    schema_version: int = SCHEMA_VERSION


def _bytes(typecode: str, values: list, what: str, group_id: str) -> bytes:
    if not values:
        return b""
    try:  # (struct: ~12 ns a value, array(...).tobytes() ~17-28)
        return struct.pack(f"<{len(values)}{typecode}", *values)
    except (struct.error, OverflowError, TypeError) as exc:
        kind = {IDS: "int32", LOGPROBS: "float32", MASK: "uint8"}[typecode]
        raise ValueError(
            f"group {group_id}: {what} holds a value that is no {kind}: {exc}"
        ) from None


def pack_sample(s: Sample, group_id: str, prompt: bytes | None = None) -> PackedSample:
    """`s` packed (`pack`'s rules; `prompt`: its prompt ids packed already); ValueError naming
    the field (and `group_id`) when a value does not fit."""
    gid = group_id
    if prompt is None:
        prompt = _bytes(IDS, s.prompt_ids, "prompt_ids", gid)
    mask, versions, n = s.loss_mask, s.token_versions, len(s.response_ids)
    return PackedSample(
        prompt,
        _bytes(IDS, s.response_ids, "response_ids", gid),
        _bytes(LOGPROBS, s.response_logprobs, "response_logprobs", gid),
        b"" if mask.count(1) == len(mask) == n else _bytes(MASK, mask, "loss_mask", gid),
        b""
        if versions.count(s.weight_version) == len(versions) == n
        else _bytes(IDS, versions, "token_versions", gid),
        s.reward,
        s.weight_version,
        s.finish_reason,
        s.response_text,
        s.routed_experts,
        s.temperature,
    )


def pack(group: SampleGroup | PackedGroup) -> PackedGroup:
    """The packed form of `group`; ValueError naming the field when a value does not fit. A
    loss mask of all 1 and token versions all the sample's, one per response token, are stored
    empty (what empty means; of another length they are kept, for the trainer to reject),
    and a prompt the samples share (one list) is packed once."""
    if isinstance(group, PackedGroup):
        return group
    gid = group.group_id
    samples, last, prompt = [], None, b""
    for s in group.samples:
        if s.prompt_ids is not last:
            last, prompt = s.prompt_ids, _bytes(IDS, s.prompt_ids, "prompt_ids", gid)
        samples.append(pack_sample(s, gid, prompt))
    return PackedGroup(
        gid,
        group.prompt,
        group.label,
        samples,
        group.weight_version,
        group.created_at,
        group.schema_version,
    )


def unpack(group: SampleGroup | PackedGroup) -> SampleGroup:
    """The list form of `group` (tools and tests; the trainer reads packed groups as they are),
    with the loss mask and token versions stored empty written out."""
    if isinstance(group, SampleGroup):
        return group
    samples = [
        Sample(
            prompt_ids=s.prompt_ids.tolist(),
            response_ids=s.response_ids.tolist(),
            response_logprobs=s.response_logprobs.tolist(),
            loss_mask=s.loss_mask.tolist() or [1] * (len(s.response) // 4),
            reward=s.reward,
            weight_version=s.weight_version,
            token_versions=s.token_versions.tolist() or [s.weight_version] * (len(s.response) // 4),
            finish_reason=s.finish_reason,
            response_text=s.response_text,
            routed_experts=s.routed_experts,
            temperature=s.temperature,
        )
        for s in group.samples
    ]
    return SampleGroup(
        group_id=group.group_id,
        prompt=group.prompt,
        label=group.label,
        samples=samples,
        weight_version=group.weight_version,
        created_at=group.created_at,
        schema_version=group.schema_version,
    )


Group = SampleGroup | PackedGroup  # what the trainer reads either way
AnySample = Sample | PackedSample

_encoder = msgspec.msgpack.Encoder()
_entry_decoder = msgspec.msgpack.Decoder(list[PackedGroup] | SampleGroup)


def encode_entry(groups: list[PackedGroup]) -> bytes:
    """The `d` of one stream entry holding `groups`."""
    return _encoder.encode(groups)


def decode_entry(payload: bytes) -> list[PackedGroup] | SampleGroup:
    """An entry's `d`: its packed groups, or one `SampleGroup`; `msgspec.DecodeError` else."""
    return _entry_decoder.decode(payload)


def group_key(entry_id: str, index: int) -> str:
    """The key of group `index` of stream entry `entry_id`."""
    return f"{entry_id}/{index}"


def entry_of(key: str) -> str:
    """The stream entry of a group key (an entry id is its own)."""
    return key.split("/")[0]


def groups_of(entry_id: str, payload: bytes) -> list[tuple[str, PackedGroup | SampleGroup]]:
    """The groups of entry `entry_id` whose `d` is `payload`, by key (`entry/index`);
    `msgspec.DecodeError` when it is neither packed groups nor a `SampleGroup`."""
    decoded = decode_entry(payload)
    groups: Sequence[Group] = [decoded] if isinstance(decoded, SampleGroup) else decoded
    return [(group_key(entry_id, i), group) for i, group in enumerate(groups)]
