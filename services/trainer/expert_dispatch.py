"""Token dispatch for MoE layers whose experts all live on this rank, with no host sync.

megatron-core's dispatchers without TransformerEngine permute tokens with `masked_select` (its
output size lives on the device, so each call waits for the GPU) and, at expert-parallel size 1,
copy the tokens per expert to the host: each MoE layer of each micro-batch stops the host until
the GPU has caught up, and the next kernels start late. Their backward sums a token's k expert
rows with `index_add_` (atomic adds in bf16).

At expert- and tensor-parallel size 1 with dropless top-k routing every token has exactly k
experts, so every size is known on the host: k x tokens rows. `SortedDispatcher` orders the rows
as megatron's `permute` does (expert by expert, tokens in order) with one stable sort on the
device, keeps the tokens per expert on the device (`GroupedExperts` takes them there), and sums
a token's k rows in one gather-and-sum kernel: no atomics, one rounding to bf16.
`DispatchingMoELayer` (megatron's `MoELayer`) builds it in place of megatron's dispatcher where
it applies; elsewhere megatron's own dispatcher runs.

Does not do: capacity factors (token dropping), expert or tensor parallelism, shared-expert
overlap, experts that need the tokens per expert on the host (`SequentialMLP`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from services.trainer.cpu_compat import fused


def _gather_sum(rows: torch.Tensor, by_token: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's k rows (`by_token`, token by token) summed in fp32, rounded once. Written
    as k gathers added up: compiled (CUDA), one elementwise kernel of k indirect loads per
    output element, reading each row once; a gather-then-reduce compiles to a slower kernel."""
    index = by_token.view(num_tokens, -1)
    total = rows.index_select(0, index[:, 0]).float()
    for j in range(1, index.shape[1]):
        total = total + rows.index_select(0, index[:, j])
    return total.to(rows.dtype)


_sum_rows = fused(_gather_sum)


class _Spread(torch.autograd.Function):
    """tokens `[T, H]` -> rows `[T*k, H]`, row r a copy of token `row_token[r]`; the backward
    sums each token's k rows."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tokens: torch.Tensor, row_token: torch.Tensor, by_token: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(by_token)
        ctx.num_tokens = tokens.shape[0]
        return tokens.index_select(0, row_token)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (by_token,) = ctx.saved_tensors
        return _sum_rows(grad, by_token, ctx.num_tokens), None, None


class _Combine(torch.autograd.Function):
    """rows `[T*k, H]` -> tokens `[T, H]`, each token the sum of its k rows (`_Spread`'s
    adjoint)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, rows: torch.Tensor, row_token: torch.Tensor, by_token: torch.Tensor, tokens: int
    ) -> torch.Tensor:
        ctx.save_for_backward(row_token)
        return _sum_rows(rows, by_token, tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (row_token,) = ctx.saved_tensors
        return grad.index_select(0, row_token), None, None, None


class SortedDispatcher(MoETokenDispatcher):
    """megatron's dispatcher interface for one rank holding every expert (see the module)."""

    def __init__(self, config: Any, pg_collection: Any) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.topk = config.moe_router_topk

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' order from `routing_map` `[T, E]`: expert-major positions of its k x T
        set entries (a stable sort of the unset ones to the end), as megatron's `permute`."""
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        num_tokens = tokens.shape[0]
        by_expert = routing_map.t().reshape(-1)
        chosen = torch.argsort((~by_expert).to(torch.uint8), stable=True)[: num_tokens * self.topk]
        self.row_token = chosen % num_tokens
        self.by_token = torch.argsort(self.row_token, stable=True)
        self.tokens_per_expert = routing_map.sum(dim=0)
        self.row_probs = probs.t().reshape(-1).index_select(0, chosen)
        return tokens, probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple:
        return hidden_states, probs

    def dispatch_postprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = _Spread.apply(hidden_states, self.row_token, self.by_token)
        return rows, self.tokens_per_expert, self.row_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = self.by_token.numel() // self.topk
        out = _Combine.apply(hidden_states, self.row_token, self.by_token, tokens)
        self.row_token = self.by_token = self.row_probs = self.tokens_per_expert = None
        return out.view(self.hidden_shape)


def applies(config: Any) -> bool:
    """Whether `SortedDispatcher` can stand in for megatron's dispatcher under `config`."""
    return (
        config.expert_model_parallel_size == 1
        and config.tensor_model_parallel_size == 1
        and config.moe_expert_capacity_factor is None
        and not config.moe_pad_expert_input_to_capacity
        and not config.moe_shared_expert_overlap
        and not config.moe_router_padding_for_quantization
    )


class DispatchingMoELayer(MoELayer):
    """megatron's `MoELayer`, with `SortedDispatcher` where `applies(config)`."""

    def __init__(self, config: Any, submodules: Any = None, **kwargs: Any) -> None:
        super().__init__(config, submodules, **kwargs)
        if applies(config):
            groups = kwargs.get("pg_collection") or get_default_pg_collection()
            self.token_dispatcher = SortedDispatcher(config, pg_collection=groups)
