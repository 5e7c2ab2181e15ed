"""Per-step metric accumulation: sums, counts and maxima over micro-batches and ranks.

Metric values are reduced once per step (one all-reduce of sums, one of maxima) and turned into
the `train/*` keys published to Redis. NaN marks "no data" (e.g. no same-version sample).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist


def comm_device() -> torch.device:
    """Where tensors for collectives live: NCCL reduces CUDA tensors only, gloo CPU ones."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class StepStats:
    """`add(name, total, count)` for means, `peak(name, value)` for maxima.

    Values may be device tensors: they are kept as they are and turned into numbers only when
    the step's metrics are read (`sums`, `maxes`, `reduce`, `mean`, `max`), so recording a
    metric in the loss never makes the host wait for the device mid-step."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._maxes: dict[str, float] = {}
        self._pending_sums: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._pending_maxes: dict[str, list[torch.Tensor]] = defaultdict(list)

    def add(
        self, name: str, total: float | torch.Tensor, count: float | torch.Tensor = 1.0
    ) -> None:
        self.count(name + ":sum", total)
        self.count(name + ":count", count)

    def count(self, name: str, n: float | torch.Tensor = 1.0) -> None:
        if isinstance(n, torch.Tensor):
            self._pending_sums[name].append(n.detach().reshape(()))
        else:
            self._sums[name] += float(n)

    def peak(self, name: str, value: float | torch.Tensor) -> None:
        if isinstance(value, torch.Tensor):
            self._pending_maxes[name].append(value.detach().reshape(()))
        else:
            self._maxes[name] = max(self._maxes.get(name, -math.inf), float(value))

    def _resolve(self) -> None:
        """Fold the pending tensors into numbers (one device-to-host copy per device)."""
        for pending, fold in ((self._pending_sums, self.count), (self._pending_maxes, self.peak)):
            if not pending:
                continue
            items = [(k, t) for k, ts in pending.items() for t in ts]
            pending.clear()
            by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
            for key, t in items:
                by_device[t.device].append((key, t))
            for group in by_device.values():
                values = torch.stack([t.double() for _, t in group]).tolist()
                for (key, _), v in zip(group, values, strict=True):
                    fold(key, v)

    @property
    def sums(self) -> dict[str, float]:
        self._resolve()
        return self._sums

    @property
    def maxes(self) -> dict[str, float]:
        self._resolve()
        return self._maxes

    def reduce(self, group: dist.ProcessGroup | None = None) -> None:
        """Sum/max over the ranks of `group` (keys a rank lacks count as 0 / -inf there)."""
        self._resolve()
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        keys_per_rank: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys_per_rank, (sorted(self.sums), sorted(self.maxes)), group=group)
        for sum_keys, max_keys in keys_per_rank:
            for k in sum_keys:
                self.sums[k] += 0.0
            for k in max_keys:
                self.maxes.setdefault(k, -math.inf)
        for store, op in ((self.sums, dist.ReduceOp.SUM), (self.maxes, dist.ReduceOp.MAX)):
            keys = sorted(store)
            if keys:
                t = torch.tensor(
                    [store[k] for k in keys], dtype=torch.float64, device=comm_device()
                )
                dist.all_reduce(t, op=op, group=group)
                store.update(zip(keys, t.tolist(), strict=True))

    def mean(self, name: str) -> float:
        count = self.sums.get(name + ":count", 0.0)
        return self.sums[name + ":sum"] / count if count else math.nan

    def max(self, name: str) -> float:
        v = self.maxes.get(name, -math.inf)
        return v if v != -math.inf else math.nan
