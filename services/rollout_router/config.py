"""The router's configuration: one dataclass with a sub-config per component.

`WorkerPoolConfig` goes to the worker pool (balancing, health, retries), `RolloutConfig` to the
rollout loop (task, batch shape, sampling, staleness), `BufferConfig` to the Redis sample buffer.
Flag names follow slime where the concept is the same (`--rollout-batch-size`,
`--n-samples-per-prompt`, `--rollout-max-response-len`, `--rollout-temperature`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.sample_buffer import BufferConfig

POLICIES = ("least_outstanding", "round_robin", "session_affinity")


@dataclass
class WorkerPoolConfig:
    """Which engines to use and how to balance, health-check and retry across them."""

    engine_urls: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Base URLs of SGLang-compatible engines (more can be added at run time)."
        },
    )
    engine_wait_timeout_s: float = field(
        default=300.0,
        metadata={"help": "How long start-up waits for every engine's /get_model_info."},
    )
    policy: str = field(
        default="least_outstanding",
        metadata={"help": "Load-balancing policy.", "choices": POLICIES},
    )
    max_retries: int = field(
        default=3,
        metadata={"help": "Extra attempts, each on another engine, before a request fails."},
    )
    request_timeout_s: float = field(
        default=600.0, metadata={"help": "Total timeout of one forwarded engine request."}
    )
    health_interval_s: float = field(
        default=1.0, metadata={"help": "Seconds between health checks (GET /get_model_info)."}
    )
    health_timeout_s: float = field(default=2.0, metadata={"help": "Timeout of one health check."})
    health_failures: int = field(
        default=3,
        metadata={"help": "Consecutive failed checks that evict an engine from the rotation."},
    )

    def validate(self) -> None:
        if self.max_retries < 0:
            raise ValueError("--max-retries must be >= 0")
        if self.health_interval_s <= 0 or self.health_failures < 1:
            raise ValueError("--health-interval-s must be > 0 and --health-failures >= 1")


@dataclass
class RolloutConfig:
    """What the rollout loop generates, how, and how far ahead of the trainer it may run."""

    rollout: bool = field(
        default=True, metadata={"help": "Run the rollout loop (--no-rollout: only route)."}
    )
    model: str = field(
        default="",
        metadata={"help": "Hugging Face model directory; its tokenizer encodes the prompts."},
    )
    rollout_batch_size: int = field(
        default=64, metadata={"help": "Prompts per rollout batch (one trainer step)."}
    )
    n_samples_per_prompt: int = field(
        default=8, metadata={"help": "Samples per prompt (the GRPO group size)."}
    )
    max_staleness: int = field(
        default=1,
        metadata={"help": "Batch b is generated with weights of version >= b - max_staleness."},
    )
    rollout_max_response_len: int = field(
        default=4, metadata={"help": "max_new_tokens of each rollout sample."}
    )
    rollout_temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature of rollouts."}
    )
    rollout_top_p: float = field(default=1.0, metadata={"help": "top_p of rollouts."})
    rollout_top_k: int = field(default=-1, metadata={"help": "top_k of rollouts (-1 = all)."})
    seed: int = field(
        default=1234,
        metadata={"help": "Seed of prompt sampling and of each request's sampling_seed."},
    )
    task_seed: int = field(
        default=1234, metadata={"help": "Seed of the toy task's train/held-out split."}
    )
    eval_interval: int = field(
        default=1,
        metadata={"help": "Evaluate held-out prompts every this many versions (0 = never)."},
    )
    version_poll_s: float = field(
        default=0.05,
        metadata={"help": "How often a waiting rollout re-reads the engines' weight version."},
    )

    def validate(self) -> None:
        if self.rollout and not self.model:
            raise ValueError("--model is required for rollouts (or pass --no-rollout)")
        if self.rollout_batch_size < 1 or self.n_samples_per_prompt < 1:
            raise ValueError("--rollout-batch-size and --n-samples-per-prompt must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("--max-staleness must be >= 0")
        if self.rollout_max_response_len < 1:
            raise ValueError("--rollout-max-response-len must be >= 1")


@dataclass
class RouterConfig:
    """Everything `tandem router` needs."""

    workers: WorkerPoolConfig = field(default_factory=WorkerPoolConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    api_token: str = field(
        default="",
        metadata={"help": "Bearer token required by mutating endpoints (empty = none)."},
    )

    def validate(self) -> None:
        self.workers.validate()
        self.rollout.validate()
