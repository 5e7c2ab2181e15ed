"""Trainer side of the NCCL (or, on CPU, gloo) weight path: `NcclWeightSender`.

Sequence for one version (the broker's `NcclCoordinator` drives it):
  1. `send(version, tensors)` offers the version's bucket metadata to the broker (`NcclOffer`).
  2. If the broker answers `init`, join the weight group as rank 0 (engines join concurrently).
  3. For each `broadcast k`, broadcast bucket k's tensors from rank 0, in listed order, and ack.
     A failed collective is acked as failed and the group dropped; the broker then either
     starts a new attempt (`init` again, without the failed engine) or aborts.
  4. `done` ends the version; `abort` abandons it (engines keep their previous version).
Every wait is bounded (receives by `timeout_s`, the rendezvous and collectives by the timeout
the broker sends with `init`), so a dead or hung engine never blocks the trainer for good. Only trainer
rank 0 creates a sender; tensors must already be gathered (full, HF names) on its device.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import zmq

from proto import NcclAck, NcclCommand, NcclOffer, TensorMeta, decode, encode
from services.weight_broker.process_group import join_group, leave_group

__all__ = ["NcclWeightSender", "WeightSyncError"]
from services.weight_broker.wire import DEFAULT_BUCKET_BYTES, WeightSyncError, group_by_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tandem.weights.nccl")


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class NcclWeightSender:
    def __init__(
        self,
        control_endpoint: str,
        master_address: str = "127.0.0.1",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 60.0,
    ) -> None:
        self.control_endpoint = control_endpoint
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group: Any = None
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(control_endpoint)

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast one version to every engine; returns the bytes sent.

        Raises `WeightSyncError` if the broker aborted the version or a wait timed out.
        """
        import torch

        # The backend follows the machine, not where the export left the tensors: engines on
        # GPUs join with NCCL, so a GPU trainer must broadcast CUDA tensors with NCCL too.
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        buckets = group_by_bytes(
            ((n, t.detach().contiguous()) for n, t in named_tensors), self.bucket_bytes
        )
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            buckets = [[(n, t.to(device)) for n, t in bucket] for bucket in buckets]
        port = _free_port(self.master_address)
        offer = NcclOffer(
            version=version,
            buckets=[
                [TensorMeta(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in b]
                for b in buckets
            ],
            master_address=self.master_address,
            master_port=port,
            backend=backend,
        )
        self._socket.send(encode(offer))
        sent = 0
        while True:
            command = self._receive(version)
            if command.action == "init":
                sent = 0
                self._join(port, command, backend)
            elif command.action == "broadcast":
                sent += self._broadcast(command, buckets[command.bucket])
            elif command.action == "done":
                return sent
            else:
                self._drop_group()
                raise WeightSyncError(f"broker aborted version {version}: {command.message}")

    def _receive(self, version: int) -> NcclCommand:
        if not self._socket.poll(int(self.timeout_s * 1000)):
            self._drop_group()
            raise WeightSyncError(
                f"weight broker at {self.control_endpoint} sent no command for "
                f"{self.timeout_s:.0f}s during version {version}"
            )
        command = decode(self._socket.recv(), NcclCommand)
        if command.version != version:
            raise WeightSyncError(f"broker answered version {command.version}, not {version}")
        return command

    def _join(self, port: int, command: NcclCommand, backend: str) -> None:
        self._drop_group()
        try:
            self.group = join_group(
                self.master_address, port, 0, command.world_size, command.group_name, backend,
                timedelta(seconds=command.timeout_s),
            )  # fmt: skip
        except Exception as exc:  # a rank never came: the broker times it out and decides
            log.warning("joining weight group %s failed: %s", command.group_name, exc)
            return
        log.info("joined %s (%d ranks, %s)", command.group_name, command.world_size, backend)

    def _broadcast(self, command: NcclCommand, bucket: list[tuple[str, torch.Tensor]]) -> int:
        import torch
        import torch.distributed as dist

        ack = NcclAck(
            version=command.version, attempt=command.attempt, bucket=command.bucket, ok=True
        )
        try:
            if self.group is None:
                raise RuntimeError("not in a weight group (joining it failed)")
            for _name, tensor in bucket:
                dist.broadcast(tensor, src=0, group=self.group)
            if bucket and bucket[0][1].is_cuda:
                torch.cuda.synchronize(bucket[0][1].device)
        except Exception as exc:  # a peer died mid-collective: this group is unusable now
            ack.ok, ack.error = False, str(exc)
            self._drop_group()
        self._socket.send(encode(ack))
        return sum(t.numel() * t.element_size() for _, t in bucket) if ack.ok else 0

    def _drop_group(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            try:
                leave_group(group)
            except Exception as exc:  # a broken communicator may refuse a clean shutdown
                log.warning("leaving the old weight group: %s", exc)

    def close(self) -> None:
        self._drop_group()
        self._socket.close()
