"""Weights through shared memory on one host: double-buffered slot files with locks.

Writer (trainer): `ShmSlots` keeps slot files in `shm_dir`, each mapped once (warm pages:
writing a version runs at memcpy speed; fresh tmpfs pages cost ~10x more). Version N goes to a
slot no reader holds: take an exclusive `flock` on it, set the stamp to -1, copy the tensors in,
set the stamp to N, unlock. Two slots suffice while engines keep up; when engines hold both
(engines two versions behind, e.g. a version lost with a killed broker, or engines at two
different versions) `grow_after_s` after the newest version was written (the time an engine
had to move on to it), a slot is added, up to `max_count`. Such a slot is held
by an engine that has not moved on for a whole version (stopped, hung, left behind by the
broker, or never told of the newest): it frees when that engine takes a newer version, which
may be never, so the writer waits only GROW_AFTER_S for it: a longer wait stalls the trainer
and saves no memory when the engine does not move (the slot is added after it all the same).
The bound counts from the newest version's write, not from this one's call: a trainer that
took longer than it for its step (e.g. waiting for the groups a stopped engine held) finds the
holder already past its chance and adds the slot at once, so one stop costs one bound.

Reader (engine): `read_slot` takes a shared `flock`, checks that the stamp equals the version it
was told about (else the slot already holds a newer version: `LookupError`), and maps the file
copy-on-write. The returned `SlotLease` must be kept for as long as the views are in use: an
engine that adopts the views as its parameter storage keeps the lease until it has moved to
the next version, which is what lets the writer reuse the slot safely.

Files are created mode 0600: only the trainer's user can write weights this way.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import math
import mmap
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proto import TensorMeta, WeightBucketHeader

if TYPE_CHECKING:
    import torch

FILE_PREFIX = "tandem-weights-"  # then the writer's pid: see remove_stale_slots
HEADER_BYTES = 64  # the stamp (int64 version) lives here; tensors start after it
ALIGN = 64
WRITING = -1
# How long every reusable slot may stay held before one is added (`max_count` bounds them): an
# engine one sync away from the next version lets its slot go within it (a sync over shared
# memory adopts the slot's pages: milliseconds, plus the drain of running requests).
GROW_AFTER_S = 1.0
log = logging.getLogger("tandem.weight_sync.shm")


class SlotBusyError(TimeoutError):
    """Engines still hold the slot the next version must go to."""


class SlotSpaceError(OSError):
    """The shared-memory folder has no room for a version (a container's /dev/shm is 64 MiB
    unless its --shm-size says more)."""


def _size(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def _lock(fd: int, mode: int, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise SlotBusyError(f"{what} stayed locked for {timeout_s:.0f}s") from None
            time.sleep(0.001)


@dataclass
class _Slot:
    path: str
    fd: int
    size: int = 0
    mapping: mmap.mmap | None = None


@dataclass
class ShmSlots:
    shm_dir: str
    count: int = 2
    max_count: int = 4
    grow_after_s: float = GROW_AFTER_S
    timeout_s: float = 120.0
    prefix: str = field(default_factory=lambda: f"{FILE_PREFIX}{os.getpid()}-{time.time_ns()}")
    _slots: list[_Slot] = field(default_factory=list)
    _last: int = -1
    _last_at: float = math.inf  # monotonic time the newest version was written (inf: none)

    def write(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> WeightBucketHeader:
        """Put a version in its slot; returns the header (no MAC) that points at it."""
        import torch

        tensors = [(name, t.detach().contiguous()) for name, t in named_tensors]
        offsets, size = [], HEADER_BYTES
        for _name, t in tensors:
            offsets.append(size)
            size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        index = self._take_free_slot()
        try:
            slot = self._grow(index, size)
        except OSError:
            fcntl.flock(self._slots[index].fd, fcntl.LOCK_UN)
            raise
        self._last, self._last_at = index, time.monotonic()
        assert slot.mapping is not None
        try:
            slot.mapping[:8] = struct.pack("<q", WRITING)
            target = torch.frombuffer(slot.mapping, dtype=torch.uint8)
            for (_name, t), offset in zip(tensors, offsets, strict=True):
                source = t.reshape(-1).view(torch.uint8)
                target[offset : offset + source.numel()].copy_(source)
            del target
            slot.mapping[:8] = struct.pack("<q", version)
        finally:
            fcntl.flock(slot.fd, fcntl.LOCK_UN)
        return WeightBucketHeader(
            version=version,
            bucket_index=0,
            num_buckets=1,
            tensors=[
                TensorMeta(n, str(t.dtype).removeprefix("torch."), list(t.shape))
                for n, t in tensors
            ],
            shm_path=slot.path,
            shm_offsets=offsets,
        )

    def _take_free_slot(self) -> int:
        """Index of a slot now locked for writing: one no reader holds, never the newest
        version's (its sync may be on the way). While readers hold all the others
        `grow_after_s` after the newest version was written, a slot is added (up to
        `max_count`); a writer waits `timeout_s` in all."""
        if not self._slots:  # files in RAM must not outlive the writer, even on an early exit
            atexit.register(self.close, linger_s=15.0)
        while len(self._slots) < self.count:
            self._add_slot()
        called = time.monotonic()
        start = min(self._last_at, called)  # (the newest version's write, once there is one)
        while True:
            for index in (i for i in range(len(self._slots)) if i != self._last):
                try:
                    fcntl.flock(self._slots[index].fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return index
                except BlockingIOError:
                    continue
            waited = time.monotonic() - start
            if waited > self.grow_after_s and len(self._slots) < self.max_count:
                log.warning(
                    "engines hold every free weight slot %.1f s after the newest version was "
                    "written (engines two or more versions behind): adding slot %d in %s",
                    waited,
                    len(self._slots),
                    self.shm_dir,
                )
                self._add_slot()
            elif time.monotonic() - called > self.timeout_s:
                raise SlotBusyError(
                    f"all {len(self._slots)} weight slots in {self.shm_dir} stayed locked by "
                    f"engines for {self.timeout_s:.0f}s"
                )
            time.sleep(0.001)

    def _add_slot(self) -> None:
        path = os.path.join(self.shm_dir, f"{self.prefix}-slot{len(self._slots)}")
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        self._slots.append(_Slot(path, fd))

    def _grow(self, index: int, size: int) -> _Slot:
        slot = self._slots[index]
        if slot.size < size:  # grow (first use, or a larger model): remap
            if slot.mapping is not None:
                slot.mapping.close()
                slot.mapping, slot.size = None, 0
            try:  # (reserved now: a page that does not fit would be SIGBUS at its first write)
                os.posix_fallocate(slot.fd, 0, size)
            except OSError as exc:
                free = os.statvfs(self.shm_dir)
                raise SlotSpaceError(
                    exc.errno,
                    f"a weight slot of {_size(size)} does not fit in {self.shm_dir} "
                    f"({_size(free.f_bavail * free.f_frsize)} free of "
                    f"{_size(free.f_blocks * free.f_frsize)}; in a container, give it "
                    "more with docker run --shm-size, or shm_size in compose.yaml)",
                ) from exc
            os.ftruncate(slot.fd, size)
            slot.mapping = mmap.mmap(slot.fd, size)
            slot.size = size
        return slot

    def close(self, linger_s: float = 0.0) -> None:
        """Unlink the slot files. With `linger_s`, first wait (at most that long) until a
        reader has taken the newest version, so the last weights still reach the engines."""
        if linger_s > 0 and 0 <= self._last < len(self._slots):
            self._wait_taken(self._slots[self._last], linger_s)
        for slot in self._slots:
            if slot.mapping is not None:
                slot.mapping.close()
            os.close(slot.fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)
        self._slots.clear()

    @staticmethod
    def _wait_taken(slot: _Slot, linger_s: float) -> None:
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline:
            try:
                fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(slot.fd, fcntl.LOCK_UN)
            except BlockingIOError:  # an engine holds it: it has the version
                time.sleep(1.0)  # grace for the other engines, synced concurrently
                return
            time.sleep(0.05)


class SlotLease:
    """A reader's shared lock on a slot; `release()` lets the writer reuse it."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


def read_slot(
    header: WeightBucketHeader, timeout_s: float = 60.0
) -> tuple[list[tuple[str, torch.Tensor]], SlotLease]:
    """Views of every tensor of `header.version` in its slot, and the lease that keeps them valid."""
    import torch

    try:
        fd = os.open(header.shm_path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise LookupError(f"weight slot {header.shm_path} is gone (did the trainer exit?)") from exc
    lease = SlotLease(fd)
    try:
        _lock(fd, fcntl.LOCK_SH, timeout_s, f"weight slot {header.shm_path} (trainer writing)")
        size = os.fstat(fd).st_size
        stamp = struct.unpack("<q", os.pread(fd, 8, 0))[0]
        if stamp != header.version:
            raise LookupError(
                f"weight slot {header.shm_path} holds version {stamp}, not {header.version} "
                "(superseded: ask for the newest version)"
            )
        # Map through a second open file: mmap dups its descriptor, and a dup would share (and
        # so outlive) the lease's flock.
        map_fd = os.open(header.shm_path, os.O_RDONLY)
        try:
            mapping = mmap.mmap(
                map_fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(map_fd)
        out = []
        for meta, offset in zip(header.tensors, header.shm_offsets, strict=True):
            dtype = getattr(torch, meta.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"tensor {meta.name!r} has unknown dtype {meta.dtype!r}")
            count = math.prod(meta.shape)
            if offset + count * torch.empty((), dtype=dtype).element_size() > size:
                raise ValueError(f"tensor {meta.name!r} lies beyond the end of {header.shm_path}")
            if count == 0:
                out.append((meta.name, torch.empty(meta.shape, dtype=dtype)))
                continue
            tensor = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset)
            out.append((meta.name, tensor.reshape(meta.shape)))
        return out, lease
    except BaseException:
        lease.release()
        raise


def remove_stale_slots(shm_dir: str, writer_pid: int) -> int:
    """Delete the slot files of a writer that is gone (e.g. killed); returns how many."""
    removed = 0
    for name in os.listdir(shm_dir):
        if name.startswith(f"{FILE_PREFIX}{writer_pid}-"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                removed += 1
    return removed
