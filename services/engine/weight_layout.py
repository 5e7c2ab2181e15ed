"""The layout of a distributed weight update: which tensors a request lists (names, dtypes,
shapes, flat buckets), parsed and checked once, and how they lie in flat receive buffers.
Used by `weights.WeightUpdater`; see `weights`' docstring for the protocol."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.engine.model_runner import LoadPlan

NamedTensors = list[tuple[str, torch.Tensor]]
Layout = list[tuple[str, torch.dtype, list[int]]]  # name, dtype and shape of each packed tensor


class UpdateError(RuntimeError):
    """A weight update failed; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class PreparedLayout:
    """A distributed update's tensors, parsed and checked once (`problem`: why the model
    refuses them, "" if it takes them). `bucket_sizes` None = one broadcast per tensor."""

    layout: Layout
    bucket_sizes: list[int] | None
    problem: str
    nbytes: list[int] = field(init=False)  # bytes of each flat bucket
    keep: bool = False  # keep receive sets (whole versions of the newest layout_id)
    receive_sets: list[ReceiveSet] = field(default_factory=list)  # at most 2

    def __post_init__(self) -> None:
        self.nbytes = [
            sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in bucket)
            for bucket in self.buckets()
        ]

    def receive_set(self, live: ReceiveSet | None, make: Callable[[], ReceiveSet]) -> ReceiveSet:
        """One of two receive sets kept for this layout: one that is not `live` (the set the
        model's parameters are views of)."""
        free = [r for r in self.receive_sets if r is not live]
        if free:
            return free[0]
        self.receive_sets.append(make())
        return self.receive_sets[-1]

    def buckets(self) -> list[Layout]:
        out, start = [], 0
        for size in self.bucket_sizes or []:
            out.append(self.layout[start : start + size])
            start += size
        return out


@dataclass
class ReceiveSet:
    """Flat receive buffers of one layout, the tensors laid out over them (raw bytes at the
    `misaligned` indices, copied out once received) and the plan to load the others."""

    flats: list[torch.Tensor]
    out: NamedTensors
    misaligned: list[int]
    plan: LoadPlan | None  # None: the layout does not fit the model


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        # Refused before any collective: receiving with a guessed dtype would expect another
        # byte length than the sender broadcasts.
        raise UpdateError(f"dtype {name!r} is not a torch dtype (e.g. bfloat16, float32)", 400)
    return dtype


def flat_views(flat: torch.Tensor, layout: Layout, out: NamedTensors) -> list[int]:
    """Append to `out` the tensors packed back to back in a flat uint8 buffer, in `layout`
    order, as views. A typed view must start on an element boundary: where the byte offset is
    not a multiple of the element size (e.g. a float32 after a bfloat16 of odd length), the
    raw bytes are appended instead, to be copied out; their indices within `layout` are
    returned."""
    misaligned = []
    offset = 0
    for index, (name, dtype, shape) in enumerate(layout):
        end = offset + math.prod(shape) * dtype.itemsize
        raw = flat[offset:end]
        if offset % dtype.itemsize:
            misaligned.append(index)
            out.append((name, raw))
        else:
            out.append((name, raw.view(dtype).view(shape)))
        offset = end
    return misaligned
