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
    """`add(name, total, count)` for means, `peak(name, value)` for maxima."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = {}

    def add(
        self, name: str, total: float | torch.Tensor, count: float | torch.Tensor = 1.0
    ) -> None:
        self.sums[name + ":sum"] += float(total)
        self.sums[name + ":count"] += float(count)

    def count(self, name: str, n: float = 1.0) -> None:
        self.sums[name] += float(n)

    def peak(self, name: str, value: float | torch.Tensor) -> None:
        v = float(value)
        self.maxes[name] = max(self.maxes.get(name, -math.inf), v)

    def reduce(self, group: dist.ProcessGroup | None = None) -> None:
        """Sum/max over the ranks of `group` (keys a rank lacks count as 0 / -inf there)."""
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
