"""The weight pipe, both ends: how a version leaves the trainer and reaches an engine.

A library like `sample_buffer` (no process of its own); the trainer, the engines and the
broker import it, and none of them imports another's folder.

- `wire`: weight buckets on ZMQ (a msgpack header frame, then raw tensor frames), their HMAC,
  the secret from `TANDEM_WEIGHT_SECRET`, `WeightSyncError`.
- `zmq_transport`: `ZmqWeightSender` (trainer -> broker intake) and `fetch_weights` (engine <-
  broker serve socket).
- `safetensors_file`: a version's buckets as one safetensors file (the disk path), tensor
  bytes from a bucket's listing.
- `shm`: one-host shared-memory slots (the trainer writes, engines map them copy-on-write).
- `nccl_sender`: `NcclWeightSender`, the trainer's side of an NCCL (gloo on CPU) broadcast
  driven by the broker's coordinator.
- `process_group`: joining and leaving a weight-update group (trainer rank 0 and every engine
  rank), the rendezvous SGLang's `/init_weights_update_group` performs.
"""

from __future__ import annotations

from typing import Any, Protocol


class WeightSender(Protocol):
    """The trainer's end of the pipe: `send` one version's HF-named tensors (returns the bytes
    sent; raises `WeightSyncError` when the version did not reach the engines), `close`."""

    def send(self, version: int, named_tensors: Any) -> int: ...

    def close(self, linger_s: float = 15.0) -> None:
        """`linger_s`: how long the last version may wait for the engines to take it."""


def make_sender(
    transport: str, endpoint: str, shm_dir: str = "", master_address: str = "127.0.0.1"
) -> WeightSender:
    """The sender for the broker's intake at `endpoint`: `zmq` (buckets, or shared-memory slots
    in `shm_dir` on one host) or `nccl` (a broadcast the broker coordinates)."""
    if transport == "nccl":
        from services.weight_sync.nccl_sender import NcclWeightSender

        return NcclWeightSender(endpoint, master_address=master_address)
    if transport != "zmq":
        raise ValueError(f"--weight-transport must be zmq or nccl, not {transport!r}")
    from services.weight_sync.wire import secret_from_env
    from services.weight_sync.zmq_transport import ZmqWeightSender

    return ZmqWeightSender(endpoint, secret=secret_from_env(), shm_dir=shm_dir or None)
