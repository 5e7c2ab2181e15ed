"""Routing replay: the trainer's MoE layers use the experts the engine chose for each token.

The engine reports, per sample, the experts each MoE layer chose at every position it ran
(`Sample.routed_experts`, positions `[0, prompt + response - 1)`, which are exactly the trainer's
input positions: token j predicts token j+1). `attach` turns them into one tensor per micro-batch
(`MicroBatch.routed_experts`, `[rows, S, moe_layers, top_k]`); `apply` hands each MoE layer its
slice through megatron-core's `RouterReplay` (`moe_enable_routing_replay`): the router still
computes its scores, and takes the given experts' probabilities instead of its own top-k.

A micro-batch with any sample whose routing is missing or of the wrong size runs with the
trainer's own routing (counted by `attach`). Does not know Redis or the loss.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from services.trainer.batching import MicroBatch, TrainSample
from services.trainer.hf_arch import HfArch


def decode(raw: bytes, positions: int, layers: int, topk: int) -> torch.Tensor | None:
    """`Sample.routed_experts` bytes -> `[positions, layers, topk]` long; None if absent or of
    another size (uint8 or int16 entries: told apart by the size)."""
    count = positions * layers * topk
    if not raw or not count or len(raw) not in (count, 2 * count):
        return None
    dtype = torch.uint8 if len(raw) == count else torch.int16
    return torch.frombuffer(bytearray(raw), dtype=dtype).long().view(positions, layers, topk)


def attach(mbs: list[MicroBatch], samples: list[TrainSample], arch: HfArch) -> int:
    """Set `routed_experts` of each micro-batch whose samples all carry their routing; returns
    how many micro-batches run without replay."""
    layers, topk = arch.num_layers, arch.moe_topk
    without = 0
    for mb in mbs:
        routes = [
            decode(samples[i].routed_experts, samples[i].input_len, layers, topk)
            for i in mb.sample_index
        ]
        if any(r is None for r in routes):
            mb.routed_experts = None
            without += 1
            continue
        rows, width = mb.input_ids.shape
        # padding positions route to experts 0..k-1 (distinct, as a real top-k); no loss there
        out = torch.arange(topk).expand(rows, width, layers, topk).clone()
        for k, (row, _start, stop) in enumerate(mb.response_spans):
            route = routes[k]
            assert route is not None
            out[row, stop - route.shape[0] : stop] = route
        mb.routed_experts = out
    return without


def routers(model: torch.nn.Module) -> list[Any]:
    """The `RouterReplay` of each MoE layer of `model`, in layer order."""
    return [m.router_replay for m in model.modules() if getattr(m, "router_replay", None)]


def apply(replays: list[Any], routes: torch.Tensor | None) -> None:
    """Make the next forward use `routes` (`[rows, S, layers, topk]`), or its own routing when
    None. megatron's MoE layer sees tokens sequence-major (`[S, rows]` flattened)."""
    for layer, replay in enumerate(replays):
        replay.clear_indices()  # also drops the backward list `set_target_indices` grows
        if routes is None:
            replay.clear_router_replay_action()
            continue
        replay.set_target_indices(routes[:, :, layer].transpose(0, 1).reshape(-1, routes.shape[-1]))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
