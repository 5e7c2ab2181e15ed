"""Configuration of the reference engine (`tandem engine`): the model it serves, how it
batches, how it takes weight updates, and where it listens. Ranges are in the field types;
`check` reads the model's config.json."""

from __future__ import annotations

from typing import Literal

from services.common.settings import Count, Positive, PositiveSeconds, Section, ServeSection
from services.common.settings import Seconds as NonNegative


class ServedSection(Section):
    """The model served and how it is loaded."""

    model: str = ""
    """Hugging Face model directory to serve (see proto.models for the model types)"""
    tokenizer: str = ""
    """tokenizer directory (default: the model directory)"""
    served_model_name: str = ""
    """model name in /v1/models (default: the model directory)"""
    device: Literal["cpu", "cuda"] = "cpu"
    """torch device to run on"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """weight/activation dtype; auto = float32 on CPU, bfloat16 on CUDA"""
    load_format: Literal["auto", "dummy"] = "auto"
    """auto = read the model directory's weights; dummy = random weights of the config's shapes,
    nothing read (as SGLang's --load-format dummy): for benchmarks whose weights arrive by a
    weight update"""
    context_length: Count = 0
    """longest prompt+output in tokens (0 = the model's max_position_embeddings)"""


class BatchSection(Section):
    """How requests are batched and how much memory they may hold."""

    max_batch_size: Positive = 1024
    """most sequences decoded together in one forward pass"""
    max_prefill_tokens: Positive = 16384
    """most (padded) prompt tokens prefilled in one forward pass"""
    max_queued_requests: Positive = 4096
    """requests waiting to start before /generate answers 503 (back-pressure)"""
    kv_cache_gb: NonNegative = 4.0
    """memory for the running sequences' keys/values; new sequences wait when it is full (0 =
    unbounded; a context longer than it holds is lowered to it). More than the device has free
    beside the weights at the start is refused (the default is lowered to it, with a warning)"""
    prompt_cache_tokens: Count = 65536
    """positions of recently prefilled prompts kept so a repeated prompt skips its prefill;
    cleared on weight updates (0 = off)"""
    num_threads: Positive = 1
    """torch CPU threads (several services share the cores)"""


class WeightsSection(Section):
    """Weight updates."""

    weight_version: int = 0
    """weight version reported until the first weight update"""
    # (-3 was taken: every weight update then timed out)
    update_timeout_s: PositiveSeconds = 120.0
    """limit for fetching weights and for waiting on in-flight requests"""
    whole_version_updates: bool = True
    """accept bucket_sizes in /update_weights_from_distributed (advertised in /get_server_info):
    a whole version arrives in one request and is applied once, which needs room for one extra
    copy of the weights while it arrives; off: one request per bucket, each applied on arrival
    (as with SGLang), extra room one bucket"""


class EngineConfig(Section):
    """Configuration of `tandem engine`."""

    served: ServedSection = ServedSection()
    batch: BatchSection = BatchSection()
    weights: WeightsSection = WeightsSection()
    # weight-update bodies list every tensor name, dtype and shape: thousands of entries
    serve: ServeSection = ServeSection(max_request_bytes=64 << 20)

    def validate(self) -> None:  # type: ignore[override]  # (pydantic's is a deprecated classmethod)
        """Raise `ValueError` naming the flag to fix (the model's folder: `check`)."""
        if not self.served.model:
            raise ValueError("--model is required (a Hugging Face model directory)")


def check(config: EngineConfig) -> list[str]:
    """Start-up checks that read the model's config.json, naming the flag to fix: a model type
    the engine runs, a sliding window --context-length does not exceed."""
    from proto.models import check_model_config, check_sliding_window, read_config

    try:
        cfg, path = read_config(config.served.model)
        check_model_config(cfg, path)
        # 0 = the model's own limit, which the runner already caps at the window
        check_sliding_window(cfg, path, config.served.context_length, "--context-length")
    except ValueError as exc:
        return [str(exc)]
    return []
