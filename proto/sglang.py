"""SGLang's HTTP request and answer bodies, named after its `io_struct` classes (v0.5.23).

Sent by the router and the broker (and any SGLang client) to an engine; received by Tandem's
reference engine, which publishes them in its OpenAPI schema and answers a body that does not
fit with 400 naming the field (as SGLang does). Each class lists every field of its io_struct
namesake (`tests/test_sglang_contract.py` checks it against the installed `sglang` source), plus
Tandem's extensions where marked. Unknown fields are refused.

The NCCL weight protocol (broker `--transport nccl`), stated here once. The trainer offers each
version to the broker (`proto.NcclOffer`: bucketed names, dtypes, shapes; the tensors stay on
the trainer's device); an offer that fails its HMAC check is answered `abort`. Then, in order:
  1. Group, if the engines changed or the last attempt failed: the broker reads each engine's
     `GET /get_server_info` (`tp_size`; whether it takes `bucket_sizes` and `layout_id`), sends
     the trainer `init` (`proto.NcclCommand`) and each engine `InitWeightsUpdateGroupReqInput`
     (rank_offset = 1 + the TP ranks before it; world = 1 + all TP ranks). Else each member
     must answer `GET /model_info` within 5 s: one that died since the group formed would
     hold the others in the broadcast for the group's timeout.
  2. Pause: `PauseGenerationReqInput` (`--pause-mode`, unless none), except to an engine that
     takes a whole version per request in mode abort: it generates on the old weights until
     the version is in, and its request carries `abort_all_requests`.
  3. Transfer: `broadcast` to the trainer, which sends every bucket from rank 0 in the
     command's `load_format` and acks (`proto.NcclAck`); each engine gets one
     `UpdateWeightsFromDistributedReqInput` with the whole version (Tandem's engine:
     `bucket_sizes`; once it took a layout, only its `layout_id`, in full again after a 409)
     or one per bucket, each sent when the previous one answered (SGLang).
  4. Resume: `ContinueGenerationReqInput` to the engines paused in 2; `done` to the trainer.
Each engine's outcome is its own: once the trainer acked, an engine that answered took the
version (`done` to the trainer); one with no answer 5 s (plus the broadcast's time) after the
ack, stopped or slow, is left behind, out of rotation, until it is registered again.
A failure or timeout takes the failing engine out of rotation; the version is tried once more
in a fresh group without it, else the trainer gets `abort` (engines keep their version) and the
next version forms a fresh group. No step waits longer than the broker's `--sync-timeout-s`.
A member that dies during a broadcast fails it for the others after the group's timeout (the
trainer's: half the sync timeout), the trainer and Tandem's engines included: they live on and
join the next group (services/weight_sync/process_group.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, WithJsonSchema, model_validator

# A weight version is a string in SGLang's JSON and an int inside Tandem: "3" (or 3) is read
# as 3, a string that is not an integer is refused naming the field, and 3 is written as "3".
Version = Annotated[
    int,
    PlainSerializer(str, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "pattern": "^-?[0-9]+$"}),
]


class _Req(BaseModel):
    """io_struct.BaseReq: every request may carry a request id."""

    model_config = ConfigDict(extra="forbid")

    rid: str | None = None
    http_worker_ipc: str | None = None


class GenerateReqInput(BaseModel):
    """`POST /generate` (published schema only: the engine parses this hot path with orjson
    and refuses a bad field with 400 naming it). Unknown top-level fields are ignored, as
    SGLang does."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    stream: bool | None = None
    return_prompt_token_ids: bool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class _OpenAIRequest(BaseModel):
    """Shared fields of SGLang's OpenAI-compatible requests (published schema only: parsed
    with orjson; other OpenAI fields are accepted)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    logprobs: bool | int | None = None


class CompletionRequest(_OpenAIRequest):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]


class ChatCompletionRequest(_OpenAIRequest):
    """`POST /v1/chat/completions` (Tandem's router also takes `session_id`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` publishing `model` as the JSON body of a route that parses it itself
    (nested models are inlined: a route's extra cannot add components)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}


class UpdateWeightsReqOutput(BaseModel):
    """An engine's answer to a weight update (`weight_version`: the version it serves now)."""

    success: bool
    message: str
    weight_version: str | None = None


class UpdateWeightFromDiskReqInput(_Req):
    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: Version | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class InitWeightsUpdateGroupReqInput(_Req):
    """Tandem extension: `timeout_s`, the group's collective timeout (an engine that advertises
    `weight_update_group_timeout`), so that every member of a broken broadcast gives up with
    the trainer, before the broker's request timeout."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(default=1, ge=1, le=65535)
    world_size: int = Field(
        ge=2, le=65536, description="the trainer (rank 0) plus every engine rank"
    )
    group_name: str = "weight_update_group"
    backend: str | None = None
    timeout_s: float | None = Field(default=None, ge=1, le=86400)

    @model_validator(mode="after")
    def _rank_in_world(self) -> InitWeightsUpdateGroupReqInput:
        if self.rank_offset >= self.world_size:
            raise ValueError(
                f"rank_offset ({self.rank_offset}) must be below world_size ({self.world_size})"
            )
        return self


class DestroyWeightsUpdateGroupReqInput(_Req):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReqInput(_Req):
    """Tandem extensions: `layout_id` (names/dtypes/shapes may then be left out when the engine
    kept that layout) and `bucket_sizes` (with load_format flattened_bucket)."""

    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Version | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False
    layout_id: str | None = None
    bucket_sizes: list[int] | None = None


class UpdateWeightVersionReqInput(_Req):
    new_version: Version
    abort_all_requests: bool = True


class GetWeightsByNameReqInput(_Req):
    name: str
    truncate_size: int = Field(default=100, ge=1)


class PauseGenerationReqInput(_Req):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Req):
    torch_empty_cache: bool = True


class AbortReq(_Req):
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    weight_versions: Any = None


class ReleaseMemoryOccupationReqInput(_Req):
    tags: list[str] | None = None


class ResumeMemoryOccupationReqInput(_Req):
    tags: list[str] | None = None


class UpdateWeightsFromZmqReqInput(_Req):
    """Tandem's own route (not in SGLang): fetch version `weight_version` from the broker."""

    endpoint: str = Field(pattern=r"^(tcp|ipc|inproc)://\S+$", examples=["tcp://127.0.0.1:5555"])
    weight_version: Version
    timeout_s: float | None = Field(default=None, gt=0)
    flush_cache: bool = True
    abort_all_requests: bool = False
