"""Configuration of the weight broker: where weights come in, where engines fetch them, and
which engines to keep in sync. Ranges are in the field types; `validate` checks the rest."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proto.run_terms import RunPlace
from services.common.settings import Positive, PositiveSeconds, Section, ServeSection
from services.sample_buffer import BufferConfig


class EndpointSection(Section):
    """The broker's ZMQ sockets and the engines it keeps in sync."""

    intake_endpoint: str = "tcp://127.0.0.1:*"
    """ZMQ endpoint the trainer pushes versions to (bind; '*' = free port)."""
    serve_endpoint: str = "tcp://127.0.0.1:*"
    """ZMQ endpoint engines fetch versions from (bind; '*' = free port)."""
    advertise_host: str = ""
    """Host engines should use to reach serve_endpoint (default: its bind host)."""
    engine_urls: list[str] = Field(default_factory=list)
    """HTTP URLs of the engines to keep in sync."""


class SyncSection(Section):
    """How versions reach the engines and how long that may take."""

    transport: Literal["zmq", "disk", "nccl"] = "zmq"
    """How engines get weights: zmq (fetch from the broker), disk (HF dir +
    /update_weights_from_disk) or nccl (trainer broadcasts into the engines' weight group; gloo
    on CPU). disk and nccl work with SGLang servers. The run's --weight-transport is nccl for
    nccl, zmq for the others (the trainer pushes zmq buckets)."""
    disk_dir: str = ""
    """disk transport: folder for version dirs, engine-visible."""
    model_dir: str = ""
    """disk transport: HF dir whose config/tokenizer files to copy."""
    pause_mode: Literal["abort", "in_place", "retract", "none"] = "abort"
    """nccl transport: /pause_generation mode around a broadcast. abort: running requests end
    (the router continues them on the new weights); in_place / retract: they continue after it,
    a response then mixes two versions; none: no pause."""
    nccl_load_format: Literal["flattened_bucket", "per_tensor"] = "flattened_bucket"
    """nccl transport: flattened_bucket (one broadcast per bucket, fast; needs an SGLang that
    takes load_format) or per_tensor (one per tensor, any SGLang)."""
    # (0 s was no bound: aiohttp takes 0 for none, and a hung engine held every sync up for good)
    sync_timeout_s: PositiveSeconds = 60.0
    """Longest one engine may take to load a version before it is taken out."""
    keep_versions: Positive = 2
    """Complete versions held in memory (the newest is what engines get)."""
    redis_call_timeout_s: PositiveSeconds = 10.0
    """Seconds a Redis call may take (off the event loop: a Redis that stops answering delays
    the published version and the status, never the syncs)."""


class BrokerConfig(Section):
    """Configuration of `tandem broker`."""

    run: RunPlace = RunPlace(redis_url="")
    endpoints: EndpointSection = EndpointSection()
    sync: SyncSection = SyncSection()
    serve: ServeSection = ServeSection(port=8300, max_request_bytes=1 << 20)

    def validate(self) -> None:  # type: ignore[override]  # (pydantic's is a deprecated classmethod)
        """ValueError naming the flag (--redis-url; empty: the synced version is published
        nowhere)."""
        self.buffer_config().validate()

    def buffer_config(self) -> BufferConfig:
        return BufferConfig(
            self.run.redis_url, self.run.run_id, redis_call_timeout_s=self.sync.redis_call_timeout_s
        )


def check(config: BrokerConfig) -> list[str]:
    """Start-up checks that touch files, each naming the flag to fix: with --transport disk,
    --disk-dir must be a folder the broker can write (each version is written there; the
    first write comes only with the first trained version)."""
    from services.common.paths import unwritable

    disk_dir = config.sync.disk_dir
    problem = (
        unwritable(disk_dir, "--disk-dir") if config.sync.transport == "disk" and disk_dir else ""
    )
    return [problem] if problem else []
