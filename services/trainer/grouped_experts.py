"""The experts of an MoE layer as two grouped GEMMs (`torch._grouped_mm`), no TransformerEngine.

megatron-core's own grouped experts need TransformerEngine (or the `grouped_gemm` package); its
local `SequentialMLP` runs one expert after another, a dozen small kernels per expert. Here all
local experts of a layer are one module with stacked weights, in `SequentialMLP`'s layout:
`weight1[j]` is local expert j's `linear_fc1` (`[gate; up]`, `[2F, H]`), `weight2[j]` its
`linear_fc2` (`[H, F]`). The dispatcher's tokens come grouped by expert, so each projection is
one `torch._grouped_mm` over all local experts (CPU: torch's reference implementation of the
same op, per-group matrix products). It plugs into megatron's `MoELayer` through the layer spec
(`experts_spec`), so the router, routing replay, token dispatcher and expert parallelism are
megatron's.

Checkpoints: `sharded_state_dict` writes the same per-expert keys, offsets and `_extra_state`
objects as `SequentialMLP`, so a checkpoint written with either loads into the other (weights
and Adam moments). HF names: `expert_views` gives each local expert's tensors under
`SequentialMLP`'s parameter names, as views (a write into one writes the weight).

Does not do: tensor parallelism inside experts (MoE runs at TP 1 here), biases, activations
other than SwiGLU, `moe_apply_probs_on_input`, FP8.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

from services.trainer.expert_dispatch import DispatchingMoELayer

FLAG = "--no-moe-grouped-experts"  # the way back to megatron's SequentialMLP


class GroupedExperts(MegatronModule):
    """All local experts of one MoE layer; megatron's experts interface (`SequentialMLP`'s)."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: Any = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if pg_collection.expt_tp.size() != 1:
            raise ValueError(f"grouped experts run at expert tensor-parallel size 1 ({FLAG})")
        swiglu = config.gated_linear_unit and config.activation_func is F.silu
        if not swiglu or config.add_bias_linear or config.moe_apply_probs_on_input:
            raise ValueError(f"grouped experts are SwiGLU experts without bias ({FLAG})")
        self.num_local_experts = num_local_experts
        self.ep_group, self.dp_group = pg_collection.ep, pg_collection.expt_dp
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        shape1, shape2 = (num_local_experts, 2 * ffn, hidden), (num_local_experts, hidden, ffn)
        self.weight1 = torch.nn.Parameter(
            torch.empty(shape1, device=device, dtype=config.params_dtype)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(shape2, device=device, dtype=config.params_dtype)
        )
        # The attributes SequentialMLP's linear layers give their weights: megatron's DDP and
        # optimizer reduce and group expert parameters by `allreduce` (False = over the
        # expert-data-parallel group only), and count them once per TP group.
        for weight, dim, stride, init in (
            (self.weight1, 1, 2, config.init_method),
            (self.weight2, 2, 1, config.output_layer_init_method),
        ):
            set_tensor_model_parallel_attributes(weight, True, dim, stride)
            weight.allreduce = config.expert_model_parallel_size == 1
            if config.perform_initialization:
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    for expert in weight.data:
                        init(expert)
        # load_state_dict gets the `_extra_state` objects written for SequentialMLP: none here
        self.register_load_state_dict_post_hook(_drop_extra_state)

    def forward(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """`tokens` `[T, H]` grouped by local expert (`tokens_per_expert` rows each), each
        row's routing weight in `probs` `[T]` -> the experts' weighted outputs `[T, H]`."""
        ends = tokens_per_expert.to(tokens.device, non_blocking=True).cumsum(0).to(torch.int32)
        fc1 = torch._grouped_mm(tokens, self.weight1.transpose(1, 2), offs=ends)
        scale = probs.unsqueeze(-1)
        if self.config.bias_activation_fusion:  # as megatron's MLP: its fused weighted SwiGLU
            hidden = weighted_bias_swiglu_impl(fc1, None, scale)
        else:
            gate, up = torch.chunk(fc1, 2, dim=-1)
            hidden = (F.silu(gate) * up * scale).to(fc1.dtype)
        return torch._grouped_mm(hidden, self.weight2.transpose(1, 2), offs=ends), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass itself (megatron's interface)."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """SequentialMLP's checkpoint entries: per global expert e, `{prefix}experts.linear_fc1
        .weight` (gate and up halves, as megatron's SwiGLU split writes them) and `linear_fc2
        .weight` at expert offset e, and their `_extra_state` objects (None)."""
        if (metadata or {}).get("singleton_local_shards"):
            raise ValueError(f"grouped experts do not write singleton local shards ({FLAG})")
        first = self.ep_group.rank() * self.num_local_experts
        total = self.ep_group.size() * self.num_local_experts
        replica = (0, 0, self.dp_group.rank())
        state: dict[str, Any] = {}
        for name, weight, linear, halves in (
            ("weight1", self.weight1, "linear_fc1", 2),
            ("weight2", self.weight2, "linear_fc2", 1),
        ):
            state[prefix + name] = ShardedTensorFactory(
                f"{prefix}experts.{linear}.weight",
                weight,
                partial(
                    _per_expert, offsets=sharded_offsets, first=first, total=total, halves=halves
                ),
                partial(_stacked, halves=halves),
                replica,
            )
            for j in range(self.num_local_experts):
                axis = (len(sharded_offsets), first + j, total)
                state[f"{prefix}{linear}._extra_state.{j}"] = make_sharded_object_for_checkpoint(
                    None,
                    f"{prefix}experts.{linear}._extra_state",
                    (*sharded_offsets, axis),
                    replica,
                )
        return state


@torch.no_grad()
def _per_expert(
    key: str,
    stacked: torch.Tensor,
    replica_id: Any,
    flattened_range: Any,
    offsets: tuple,
    first: int,
    total: int,
    halves: int,
) -> list[ShardedTensor]:
    """One ShardedTensor per local expert (per half of fc1's rows), in SequentialMLP's places."""
    if flattened_range is not None:
        raise ValueError(f"grouped experts do not save a distributed optimizer's shards ({FLAG})")
    pre = len(offsets)
    pieces = []
    for j, weight in enumerate(stacked):
        for h, piece in enumerate(weight.chunk(halves)):
            rows = ((pre + 1, h, halves),) if halves > 1 else ()
            pieces.append(
                ShardedTensor.from_rank_offsets(
                    key,
                    piece,
                    *offsets,
                    (pre, first + j, total),
                    *rows,
                    replica_id=replica_id,
                    prepend_axis_num=pre + 1,
                )
            )
    return pieces


@torch.no_grad()
def _stacked(pieces: list[torch.Tensor], halves: int) -> torch.Tensor:
    """Inverse of `_per_expert` (the halves of an expert are consecutive)."""
    stacked = torch.stack(pieces)
    return stacked.view(-1, halves * stacked.shape[1], stacked.shape[2])


def _drop_extra_state(module: torch.nn.Module, incompatible: Any) -> None:
    for key in [k for k in incompatible.unexpected_keys if "_extra_state" in k]:
        incompatible.unexpected_keys.remove(key)


def experts_spec(layer_spec: Any) -> Any:
    """`layer_spec` (megatron's local GPT layer spec with an MoE MLP) with these experts, and
    the MoE layer that dispatches to them without host syncs where it can (`expert_dispatch`)."""
    layer_spec.submodules.mlp.module = DispatchingMoELayer
    layer_spec.submodules.mlp.submodules.experts.module = GroupedExperts
    layer_spec.submodules.mlp.submodules.experts.submodules = None
    return layer_spec


def expert_views(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`model`'s parameters by name, each `GroupedExperts`' weights as per-expert views under
    SequentialMLP's names (`...experts.local_experts.{j}.linear_fc{1,2}.weight`)."""
    for name, param in model.named_parameters():
        head, _, tail = name.rpartition(".")
        if tail not in ("weight1", "weight2") or not head.endswith(".experts"):
            yield name, param
            continue
        linear = "linear_fc1" if tail == "weight1" else "linear_fc2"
        for j, expert in enumerate(param):
            yield f"{head}.local_experts.{j}.{linear}.weight", expert
