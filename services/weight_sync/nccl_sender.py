"""Trainer side of the NCCL (or, on CPU, gloo) weight path: `NcclWeightSender`, rank 0 of the
weight group. The protocol it follows with the broker is stated in proto/sglang.py's docstring;
what the sender does at each command:
  - `send(version, tensors)` offers the bucket metadata (`NcclOffer`) with `layout_id`, a hash
    of it. When the same tensors over the same storage come back (the trainer's export returns
    the same objects each version), the buckets, metadata and byte views of the last version
    are reused: no per-tensor work.
  - `init`: join the weight group as rank 0 (engines join concurrently).
  - `broadcast`: send every bucket back to back in the command's `load_format`, then ack once.
    `flattened_bucket`: bucket k is packed into a flat uint8 buffer (its tensors' bytes in
    offer order, no padding) and broadcast with `async_op=True`. Two buffers, sized to the
    largest bucket, take turns: before packing into one, we `wait()` on the broadcast that
    last read it. On NCCL that wait makes the current CUDA stream wait, not the host, so the
    host queues every pack and broadcast at once and the device overlaps packing bucket k+1
    with sending bucket k. A bucket of one tensor is sent from the tensor itself. On CUDA,
    packing is one device-to-device copy per tensor: on H200s, packing 16 GiB with one
    `torch.cat` kernel per bucket slowed the concurrent broadcasts by 5.6 ms (53.0 ms vs 47.4
    for the same buckets unpacked), plain copies by 2.9 ms. On CPU, one `cat`. The first
    buckets are smaller (1/8, 1/4, 1/2 of the bucket size, `group_by_bytes(ramp=True)`), so
    the first broadcast starts after a short pack. `per_tensor`: each tensor is broadcast as
    it is, back to back. Then wait for every collective, synchronize the device and ack
    (`NcclAck`); a failed collective is acked as failed and the group dropped.
  - `done` ends the version; `abort` abandons it (engines keep their previous version).
Every wait is bounded (receives by `timeout_s`, the rendezvous and collectives by the timeout
the broker sends with `init`), so a dead or hung engine never blocks the trainer for good: the
broadcast's wait raises (on NCCL too: see process_group.py), the version is acked as failed and
the group kept aside; the broker retries with a fresh group or aborts the version. (Before each
broadcast the broker also checks that every member answers, so an engine that died between
versions costs no timeout.) Only trainer rank 0 creates a sender; tensors must already be
gathered (full, HF names) on its device. Memory: two flat buffers of the largest bucket while a
version is sent (2 x `bucket_bytes` by default).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from proto import NcclAck, NcclCommand, NcclOffer, TensorMeta, decode, encode
from services.weight_sync.process_group import join_group, leave_group, wait_all

__all__ = ["NcclWeightSender", "WeightSyncError"]
from services.weight_sync.wire import (
    DEFAULT_BUCKET_BYTES,
    WeightSyncError,
    check_weight_bind,
    group_by_bytes,
    offer_mac,
    secret_from_env,
)

if TYPE_CHECKING:
    import torch

    Buckets = list[list[tuple[str, torch.Tensor]]]

log = logging.getLogger("tandem.weights.nccl")


def _sendable(name: str, tensor: torch.Tensor, device: Any) -> tuple[str, torch.Tensor]:
    """The tensor as broadcast: contiguous, without autograd, on `device` (None = where it is).
    Each step only when needed: a version has thousands of tensors, and `detach()` or
    `contiguous()` on every one of them costs milliseconds of the sync."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if device is not None and tensor.device != device:
        tensor = tensor.to(device)
    return name, tensor


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
        layout_ids: bool = True,
    ) -> None:
        """`layout_ids=False` offers no `layout_id` (engines then get every name each
        version; `bench/weight_sync.py --layout-id compare` measures what the id saves)."""
        # The rendezvous (a TCP store this trainer hosts) must not face other machines unsigned.
        check_weight_bind("--weights-master-address", master_address)
        self.control_endpoint = control_endpoint
        self.layout_ids = layout_ids
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group: Any = None
        self.group_timeout = timedelta(seconds=timeout_s)  # the broker's, from its `init`
        self.broadcast_s = 0.0  # last version: from the broker's command to the last byte sent
        self.frames_rejected = 0  # control frames that were not an NcclCommand
        self._last: _Layout | None = None  # the last version's layout, reused while it holds
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
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        layout = self._layout(list(named_tensors), device)
        port = _free_port(self.master_address)
        offer = NcclOffer(
            version=version,
            buckets=layout.metas,
            master_address=self.master_address,
            master_port=port,
            backend=backend,
            layout_id=layout.layout_id if self.layout_ids else "",
        )
        offer.mac = offer_mac(offer, secret_from_env())
        self._socket.send(encode(offer))
        sent = 0
        while True:
            command = self._receive(version)
            if command.action == "init":
                sent = 0
                self._join(port, command, backend)
            elif command.action == "broadcast":
                sent += self._broadcast(command, layout)
            elif command.action == "done":
                return sent
            else:
                self._drop_group()
                raise WeightSyncError(f"broker aborted version {version}: {command.message}")

    def _layout(self, named: list[tuple[str, torch.Tensor]], device: Any) -> _Layout:
        """The version's buckets and their metadata; the last version's when these are the
        same tensors over the same storage (a trainer exporting views of its parameters sends
        the same objects every version): thousands of tensors make this milliseconds."""
        last = self._last
        if (
            last is not None
            and len(named) == len(last.named)
            and all(
                n == ln and t is lt and t.data_ptr() == ptr
                for (n, t), (ln, lt), ptr in zip(named, last.named, last.storage, strict=True)
            )
        ):
            return last
        sendable = [_sendable(n, t, device) for n, t in named]
        buckets = group_by_bytes(sendable, self.bucket_bytes, ramp=True)
        metas = [
            [TensorMeta(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in b]
            for b in buckets
        ]
        layout = _Layout(
            named=named,
            storage=[t.data_ptr() for _, t in named],
            buckets=buckets,
            metas=metas,
            layout_id=hashlib.blake2b(msgspec.msgpack.encode(metas), digest_size=12).hexdigest(),
            nbytes=[sum(t.nbytes for _, t in b) for b in buckets],
        )
        # Reused only if every tensor is sent from its own storage: a copy made here (to
        # make it contiguous or move it) would go stale while the original trains on.
        same = all(
            a.data_ptr() == b.data_ptr() for (_, a), (_, b) in zip(sendable, named, strict=True)
        )
        self._last = layout if same else None
        return layout

    def _receive(self, version: int) -> NcclCommand:
        """The broker's next command; a malformed frame is counted and skipped."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not self._socket.poll(left_ms):
                self._drop_group()
                raise WeightSyncError(
                    f"weight broker at {self.control_endpoint} sent no command for "
                    f"{self.timeout_s:.0f}s during version {version}"
                )
            frames = self._socket.recv_multipart()
            try:
                command = decode(frames[-1], NcclCommand)
                break
            except ValueError as exc:
                self.frames_rejected += 1
                log.warning("ignored a malformed control frame from the broker: %s", exc)
        if command.version != version:
            raise WeightSyncError(f"broker answered version {command.version}, not {version}")
        return command

    def _join(self, port: int, command: NcclCommand, backend: str) -> None:
        self._drop_group()
        self.group_timeout = timedelta(seconds=command.timeout_s)
        try:
            self.group = join_group(
                self.master_address,
                port,
                0,
                command.world_size,
                command.group_name,
                backend,
                timedelta(seconds=command.timeout_s),
            )
        except Exception as exc:  # a rank never came: the broker times it out and decides
            log.warning("joining weight group %s failed: %s", command.group_name, exc)
            return
        log.info("joined %s (%d ranks, %s)", command.group_name, command.world_size, backend)

    def _broadcast(self, command: NcclCommand, layout: _Layout) -> int:
        """Send every bucket (see the module docstring), then ack once; returns bytes sent."""
        import torch

        buckets = layout.buckets
        ack = NcclAck(
            version=command.version, attempt=command.attempt, bucket=command.bucket, ok=True
        )
        started = time.perf_counter()
        try:
            if self.group is None:
                raise RuntimeError("not in a weight group (joining it failed)")
            if command.load_format == "per_tensor":
                works = [self._start(t) for bucket in buckets for _, t in bucket]
            elif command.load_format == "flattened_bucket":
                works = self._broadcast_flat(layout)
            else:
                raise RuntimeError(f"unknown load_format {command.load_format!r} from the broker")
            wait_all(works, self.group_timeout)
            device = next((t.device for b in buckets for _, t in b), None)
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # a peer died mid-collective: this group is unusable now
            ack.ok, ack.error = False, str(exc)
            self._drop_group(failed=True)
        self._socket.send(encode(ack))
        self.broadcast_s = time.perf_counter() - started
        return sum(layout.nbytes) if ack.ok else 0

    def _broadcast_flat(self, layout: _Layout) -> list[Any]:
        import torch

        buckets = layout.buckets
        if layout.byte_views is None:
            layout.byte_views = [[_byte_view(t) for _, t in b] for b in buckets]
        sizes = layout.nbytes
        to_pack = [k for k, b in enumerate(buckets) if len(b) > 1]
        ring: list[torch.Tensor] = []
        if to_pack:
            device = buckets[to_pack[0]][0][1].device
            largest = max(sizes[k] for k in to_pack)
            ring = [
                torch.empty(largest, dtype=torch.uint8, device=device)
                for _ in range(min(2, len(to_pack)))
            ]
        last_use: list[Any] = [None] * len(ring)  # the broadcast that last read each buffer
        works: list[Any] = []
        packed = 0
        for views, nbytes in zip(layout.byte_views, sizes, strict=True):
            if len(views) <= 1:  # nothing to pack: send the tensor's own bytes
                works.extend(self._start(view) for view in views)
                continue
            slot = packed % len(ring)
            packed += 1
            if last_use[slot] is not None:
                last_use[slot].wait()  # NCCL: the stream waits, the host goes on
            flat = ring[slot][:nbytes]
            if not flat.is_cuda:  # one call: per-tensor calls cost the host more than cat
                torch.cat(views, out=flat)
            else:  # plain copies, not one cat kernel: see the module docstring
                offset = 0
                for view in views:
                    flat[offset : offset + view.numel()].copy_(view)
                    offset += view.numel()
            last_use[slot] = self._start(flat)
            works.append(last_use[slot])
        return works

    def _start(self, tensor: torch.Tensor) -> Any:
        import torch.distributed as dist

        return dist.broadcast(tensor, src=0, group=self.group, async_op=True)

    def _drop_group(self, failed: bool = False) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            try:
                leave_group(group, failed)
            except Exception as exc:  # a broken communicator may refuse a clean shutdown
                log.warning("leaving the old weight group: %s", exc)

    def close(self, linger_s: float = 0.0) -> None:  # a broadcast is over when send returns
        self._drop_group()
        self._socket.close()


@dataclass
class _Layout:
    """A version's tensors as sent: buckets, their metadata and its content hash (the offer's
    `layout_id`), the flat path's byte views; `storage` holds each given tensor's data
    pointer, to tell whether the next version's tensors are these (a parameter given a new
    `.data` keeps its identity, not its storage)."""

    named: list[tuple[str, torch.Tensor]]
    storage: list[int]
    buckets: Buckets
    metas: list[list[TensorMeta]]
    layout_id: str
    nbytes: list[int]  # of each bucket
    byte_views: list[list[torch.Tensor]] | None = None


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 tensor (no copy)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)
