"""Message structs and their msgpack codec.

Versioning: every top-level message carries `schema_version`. A receiver that sees a version it
does not know fails loudly (`decode` raises) instead of guessing at fields.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

SCHEMA_VERSION = 1


class Sample(msgspec.Struct, kw_only=True):
    """One generated response to a prompt.

    Sent by the rollout router (inside a `SampleGroup`), received by the trainer.
    `response_ids`/`response_logprobs` are exactly the engine's `output_token_logprobs`; the
    trainer trains on these ids. `loss_mask` has one entry per response token (1 = train on it;
    0 = a token the policy did not produce, e.g. an environment's reply in a multi-turn episode).
    `token_versions` is the weight version that produced each response token; it differs from
    `weight_version` only when a partial rollout was continued on newer weights.
    `routed_experts` (MoE models, when the router asks engines for them): the experts each MoE
    layer chose at every position the engine ran, `[len(prompt_ids) + len(response_ids) - 1,
    moe_layers, top_k]` row-major, one byte per entry (uint8) when every index is < 256, else
    two (int16, little-endian); see `proto.models.pack_routed_experts`. Empty = not recorded.
    `temperature`: the temperature of the distribution `response_logprobs` are of, the engine's
    `log_softmax(logits / temperature)`: the sampling temperature, 1 for greedy sampling (whose
    log-probs SGLang reports unscaled). The trainer scores the sample at the same temperature.
    Samples are drawn with no other filter (top_p 1, top_k -1, min_p 0): the router refuses any
    other for what it trains on.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    loss_mask: list[int]
    reward: float
    weight_version: int
    token_versions: list[int] = []
    finish_reason: str = "stop"
    response_text: str = ""
    routed_experts: bytes = b""
    temperature: float = 1.0


class SampleGroup(msgspec.Struct, kw_only=True):
    """All samples of one prompt (GRPO's group). Router -> Redis stream -> trainer.

    `weight_version` is the oldest version among the samples; the trainer's staleness filter
    compares it with its own version.
    """

    group_id: str
    prompt: str
    label: str
    samples: list[Sample]
    weight_version: int
    created_at: float
    schema_version: int = SCHEMA_VERSION


class DropRecord(msgspec.Struct, kw_only=True):
    """Groups or samples that will not be trained on, and why. Any service -> Redis.

    `reason` is a `proto.drops.DropReason` value. `count` is in whole groups: 1 (the default)
    for a group dropped, 0 when only some samples of a group that is still put are dropped. `samples` is
    the number of samples dropped (those of the dropped group, or the single ones). The buffer
    counts each in its own unit (`{reason}:groups`, `{reason}:samples`)."""

    source: str
    reason: str
    count: int = 1
    samples: int = 0
    group_id: str = ""
    detail: str = ""
    weight_version: int = -1
    created_at: float = 0.0
    schema_version: int = SCHEMA_VERSION


class MetricsRecord(msgspec.Struct, kw_only=True):
    """Metrics of one step, keyed as paths (`train/loss`, `eval/accuracy`).

    Sent by the trainer (per optimizer step) and the router (per rollout and per evaluation)
    into the metrics stream; read by `tandem up`, which prints progress and writes
    `metrics.jsonl`. `step` is the trainer step (= weight version) the values belong to.
    """

    source: str
    step: int
    values: dict[str, float]
    time: float
    schema_version: int = SCHEMA_VERSION


class TensorMeta(msgspec.Struct, array_like=True):
    """Name (Hugging Face checkpoint name), dtype (torch name, e.g. "bfloat16") and shape of one
    tensor whose raw little-endian bytes follow its header as one frame."""

    name: str
    dtype: str
    shape: list[int]


class WeightBucketHeader(msgspec.Struct, kw_only=True):
    """First frame of a weight bucket; one raw frame per tensor follows, in `tensors` order.

    Trainer -> broker (ZMQ PUSH) and broker -> engine (ZMQ ROUTER reply). A version is complete
    when buckets 0..num_buckets-1 have arrived. `mac` is an HMAC-SHA256 over the header (with
    `mac` empty) and every frame, keyed by the shared secret; empty when no secret is set.
    On one host the payload may instead sit in a shared-memory file: then no frames follow,
    tensor i starts at byte `shm_offsets[i]` of `shm_path`, and the MAC covers the header only
    (the file is created mode 0600, so only the trainer's user can write it).
    """

    version: int
    bucket_index: int
    num_buckets: int
    tensors: list[TensorMeta]
    mac: bytes = b""
    shm_path: str = ""
    shm_offsets: list[int] = []
    schema_version: int = SCHEMA_VERSION


class WeightRequest(msgspec.Struct, kw_only=True):
    """Engine -> broker (ZMQ DEALER): "send me every bucket of version `version`"."""

    version: int
    schema_version: int = SCHEMA_VERSION


class NcclOffer(msgspec.Struct, kw_only=True):
    """Trainer rank 0 -> broker (ZMQ DEALER -> ROUTER): version `version` is ready on the
    trainer's devices, grouped into `buckets` (consecutive tensors, at most the trainer's
    bucket size each). Tensors stay on the trainer; only their metadata travels.
    `master_address:master_port` is where the trainer will host the process-group rendezvous
    if the broker asks it to (re)form the group."""

    version: int
    buckets: list[list[TensorMeta]]
    master_address: str
    master_port: int
    backend: str
    layout_id: str = ""  # a hash of `buckets`: the same id means the same names, dtypes, shapes
    mac: bytes = b""  # HMAC-SHA256 of the offer with mac empty, under TANDEM_WEIGHT_SECRET
    schema_version: int = SCHEMA_VERSION


class NcclCommand(msgspec.Struct, kw_only=True):
    """Broker -> trainer, in answer to an offer: `init` (join group `group_name` of
    `world_size` ranks as rank 0, collectives bounded by `timeout_s`), `broadcast` (send every
    bucket of the version now, back to back, in `load_format`; `bucket` is -1 = all), `done`
    (every engine in rotation has the version) or `abort` (give up this version; `message`
    says why; the sequence: proto/sglang.py). After a failure the broker may start a new
    `attempt` of the same version (a fresh group without the failed engines, from the first
    bucket).

    `load_format` is the broker's `--nccl-load-format`: `flattened_bucket` = one broadcast per
    bucket of a 1-D uint8 tensor holding the bucket's tensors' bytes back to back in offer
    order, no padding; `per_tensor` = one broadcast per tensor in offer order."""

    action: str
    version: int
    attempt: int = 0
    bucket: int = -1
    load_format: str = "flattened_bucket"
    world_size: int = 0
    group_name: str = ""
    timeout_s: float = 60.0
    message: str = ""
    schema_version: int = SCHEMA_VERSION


class NcclAck(msgspec.Struct, kw_only=True):
    """Trainer -> broker: the `broadcast` of `version` finished on the trainer's side (every
    collective completed, device synchronized), or failed (`ok` false, `error`). `attempt` and
    `bucket` echo the command's, so a late ack of an abandoned attempt is recognised."""

    version: int
    attempt: int
    bucket: int
    ok: bool
    error: str = ""
    schema_version: int = SCHEMA_VERSION


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}  # one per message type: built once, not per call
T = TypeVar("T")


def encode(message: Any) -> bytes:
    """msgpack bytes of a message struct."""
    return _encoder.encode(message)


def decode(data: bytes, message_type: type[T]) -> T:
    """Decode and check `schema_version`; raises `ValueError` naming the message type."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    try:
        message = decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed {message_type.__name__}: {exc}") from exc
    version = getattr(message, "schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{message_type.__name__} has schema_version {version}; this build speaks "
            f"{SCHEMA_VERSION}. Run the same Tandem version in every service."
        )
    return message
