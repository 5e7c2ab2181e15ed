"""Configuration of the weight broker."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.sample_buffer import BufferConfig


@dataclass
class BrokerConfig:
    """Where weights come in, where engines fetch them, and which engines to keep in sync."""

    intake_endpoint: str = field(
        default="tcp://127.0.0.1:*",
        metadata={"help": "ZMQ endpoint the trainer pushes versions to (bind; '*' = free port)."},
    )
    serve_endpoint: str = field(
        default="tcp://127.0.0.1:*",
        metadata={"help": "ZMQ endpoint engines fetch versions from (bind; '*' = free port)."},
    )
    advertise_host: str = field(
        default="",
        metadata={
            "help": "Host engines should use to reach serve_endpoint (default: its bind host)."
        },
    )
    engine_urls: list[str] = field(
        default_factory=list, metadata={"help": "HTTP URLs of the engines to keep in sync."}
    )
    redis_url: str = field(
        default="", metadata={"help": "Redis URL; when set, the synced version is published there."}
    )
    run_id: str = field(default="default", metadata={"help": "Run id (Redis key prefix)."})
    redis_call_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "Seconds a Redis call may take (off the event loop: a Redis that stops "
            "answering delays the published version and the status, never the syncs)."
        },
    )
    sync_timeout_s: float = field(
        default=60.0,
        metadata={"help": "Longest one engine may take to load a version before it is taken out."},
    )
    transport: str = field(
        default="zmq",
        metadata={
            "help": "How engines get weights: zmq (fetch from the broker), disk (HF dir + "
            "/update_weights_from_disk) or nccl (trainer broadcasts into the engines' weight "
            "group; gloo on CPU). disk and nccl work with SGLang servers.",
            "choices": ["zmq", "disk", "nccl"],
        },
    )
    disk_dir: str = field(
        default="", metadata={"help": "disk transport: folder for version dirs, engine-visible."}
    )
    model_dir: str = field(
        default="",
        metadata={"help": "disk transport: HF dir whose config/tokenizer files to copy."},
    )
    pause_mode: str = field(
        default="abort",
        metadata={
            "help": "nccl transport: /pause_generation mode around a broadcast. abort: running "
            "requests end (the router continues them on the new weights); in_place / retract: "
            "they continue after it, a response then mixes two versions; none: no pause.",
            "choices": ["abort", "in_place", "retract", "none"],
        },
    )
    nccl_load_format: str = field(
        default="flattened_bucket",
        metadata={
            "help": "nccl transport: flattened_bucket (one broadcast per bucket, fast; needs "
            "an SGLang that takes load_format) or per_tensor (one per tensor, any SGLang).",
            "choices": ["flattened_bucket", "per_tensor"],
        },
    )
    keep_versions: int = field(
        default=2,
        metadata={"help": "Complete versions held in memory (the newest is what engines get)."},
    )

    def validate(self) -> None:
        """ValueError naming the flag (0 s was no bound: aiohttp takes 0 for none, and a hung
        engine held every sync up for good; 0 versions was taken for 1)."""
        if not self.sync_timeout_s > 0:
            raise ValueError(f"--sync-timeout-s must be > 0, got {self.sync_timeout_s:g}")
        if self.keep_versions < 1:
            raise ValueError(f"--keep-versions must be at least 1, got {self.keep_versions}")
        self.buffer_config().validate()

    def buffer_config(self) -> BufferConfig:
        return BufferConfig(
            self.redis_url, self.run_id, redis_call_timeout_s=self.redis_call_timeout_s
        )
