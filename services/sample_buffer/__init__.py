"""Redis-streams buffer between the rollout router (producer) and the trainer (consumer)."""

from services.sample_buffer.buffer import BufferConfig, BufferFullError, SampleBuffer
from services.sample_buffer.server import RedisServer, find_server_binary

__all__ = ["BufferConfig", "BufferFullError", "RedisServer", "SampleBuffer", "find_server_binary"]
