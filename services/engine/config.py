"""Configuration of the reference engine (`tandem engine`): one dataclass, one flag per field."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.models import check_model_config, check_sliding_window, read_config


@dataclass
class EngineConfig:
    """Everything `tandem engine` needs besides `--host/--port/--ready-file`."""

    model: str = field(
        default="",
        metadata={
            "help": "Hugging Face model directory to serve (see proto.models for the model types)"
        },
    )
    tokenizer: str = field(
        default="", metadata={"help": "tokenizer directory (default: the model directory)"}
    )
    device: str = field(
        default="cpu", metadata={"help": "torch device to run on", "choices": ["cpu", "cuda"]}
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weight/activation dtype; auto = float32 on CPU, bfloat16 on CUDA",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    load_format: str = field(
        default="auto",
        metadata={
            "help": "auto = read the model directory's weights; dummy = random weights of the "
            "config's shapes, nothing read (as SGLang's --load-format dummy): for benchmarks "
            "whose weights arrive by a weight update",
            "choices": ["auto", "dummy"],
        },
    )
    weight_version: str = field(
        default="0", metadata={"help": "weight version reported until the first weight update"}
    )
    max_batch_size: int = field(
        default=1024, metadata={"help": "most sequences decoded together in one forward pass"}
    )
    max_prefill_tokens: int = field(
        default=16384,
        metadata={"help": "most (padded) prompt tokens prefilled in one forward pass"},
    )
    max_queued_requests: int = field(
        default=4096,
        metadata={"help": "requests waiting to start before /generate answers 503 (back-pressure)"},
    )
    kv_cache_gb: float = field(
        default=4.0,
        metadata={
            "help": "memory for the running sequences' keys/values; new sequences wait "
            "when it is full (0 = unbounded; a context longer than it holds is lowered to "
            "it). More than the device has free beside the "
            "weights at the start is refused (the default is lowered to it, with a warning)"
        },
    )
    prompt_cache_tokens: int = field(
        default=65536,
        metadata={
            "help": "positions of recently prefilled prompts kept so a repeated prompt "
            "skips its prefill; cleared on weight updates (0 = off)"
        },
    )
    context_length: int = field(
        default=0,
        metadata={
            "help": "longest prompt+output in tokens (0 = the model's max_position_embeddings)"
        },
    )
    num_threads: int = field(
        default=1, metadata={"help": "torch CPU threads (several services share the cores)"}
    )
    update_timeout_s: float = field(
        default=120.0,
        metadata={"help": "limit for fetching weights and for waiting on in-flight requests"},
    )
    whole_version_updates: bool = field(
        default=True,
        metadata={
            "help": "accept bucket_sizes in /update_weights_from_distributed (advertised "
            "in /get_server_info): a whole version arrives in one request and is "
            "applied once, which needs room for one extra copy of the weights "
            "while it arrives; off: one request per bucket, each applied on "
            "arrival (as with SGLang), extra room one bucket"
        },
    )
    served_model_name: str = field(
        default="", metadata={"help": "model name in /v1/models (default: the model directory)"}
    )

    def validate(self) -> None:
        """Raise `ValueError` naming the flag to fix."""
        if not self.model:
            raise ValueError("--model is required (a Hugging Face model directory)")
        self.validate_numbers()
        cfg, path = read_config(self.model)
        check_model_config(cfg, path)
        # 0 = the model's own limit, which the runner already caps at the window
        check_sliding_window(cfg, path, self.context_length, "--context-length")

    def validate_numbers(self) -> None:
        """`validate`'s checks that need no model (tandem up's, before the model is there)."""
        for name in ("max_batch_size", "max_prefill_tokens", "max_queued_requests", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.prompt_cache_tokens < 0:
            raise ValueError("--prompt-cache-tokens must be >= 0")
        if self.kv_cache_gb < 0:
            raise ValueError("--kv-cache-gb must be >= 0")
        if self.update_timeout_s <= 0:  # (-3 was taken: every weight update then timed out)
            raise ValueError("--update-timeout-s must be > 0")
        if self.context_length < 0:
            raise ValueError("--context-length must be 0 (model default) or positive")
