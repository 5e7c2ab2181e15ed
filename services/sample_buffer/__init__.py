"""Redis-streams buffer between the rollout router (producer) and the trainer (consumer)."""

from services.sample_buffer.aio import AsyncSampleBuffer
from services.sample_buffer.buffer import (
    BufferConfig,
    BufferLimits,
    SampleBuffer,
    redis_url_problem,
)
from services.sample_buffer.read_ahead import ReadAhead, tune_gc_for_reads
from services.sample_buffer.server import RedisServer, find_server_binary

__all__ = [
    "AsyncSampleBuffer",
    "BufferConfig",
    "BufferLimits",
    "ReadAhead",
    "RedisServer",
    "SampleBuffer",
    "find_server_binary",
    "redis_url_problem",
    "tune_gc_for_reads",
]
