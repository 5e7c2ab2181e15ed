"""Hugging Face <-> megatron-core `GPTModel` weights (the architecture is `hf_arch`'s).

Knows: megatron's local-spec parameter names, the per-query-group interleave of `linear_qkv`
(`[ng, (nh/ng + 2) * hn, hidden]`, each group = its q heads | k | v), `linear_fc1` = `[gate; up]`,
Qwen3's `q_layernorm`/`k_layernorm` (HF `q_norm`/`k_norm`), Qwen3-MoE's router (HF `mlp.gate`)
and experts (HF `mlp.experts.{e}.{gate,up,down}_proj`, megatron `local_experts.{j}` holding
global expert `ep_rank * experts_per_rank + j`), vocabulary padding, and how tensor-parallel
shards split (embedding, output_layer, qkv, fc1 on dim 0; proj, fc2 on dim 1; norms and the
router replicated; experts split like the dense MLP).

Does not know: checkpoints on disk beyond `model.safetensors` shards, training, or the wire.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Container, Iterator, Mapping
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from services.trainer.grouped_experts import expert_views
from services.trainer.hf_arch import (
    HfArch,
    arch_from_config,
    build_gpt_model,
    read_hf_arch,
    transformer_config,
)
from services.trainer.hf_files import HfState

__all__ = [
    "HfArch",
    "arch_from_config",
    "build_gpt_model",
    "export_hf",
    "load_hf_into_model",
    "load_hf_state",
    "read_hf_arch",
    "transformer_config",
]

log = logging.getLogger("tandem.trainer.hf_convert")


# --- weights -----------------------------------------------------------------------------------


def _tp() -> tuple[int, int]:
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def _interleave_qkv(
    arch: HfArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """HF q, k, v (rows = heads * head_dim) -> megatron's per-group [q heads | k | v] rows."""
    ng, hn = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // ng
    tail = q.shape[1:]
    q = q.reshape(ng, per * hn, *tail)
    k = k.reshape(ng, hn, *tail)
    v = v.reshape(ng, hn, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(
    arch: HfArch, qkv: torch.Tensor, grouped: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_interleave_qkv` on the full (TP-gathered) tensor. With `grouped`, views
    of `qkv` shaped `[groups, rows per group, ...]` instead of HF's `[rows, ...]` (which
    strided slices cannot be without a copy)."""
    ng, hn = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // ng
    tail = qkv.shape[1:]
    q, k, v = torch.split(qkv.reshape(ng, (per + 2) * hn, *tail), [per * hn, hn, hn], dim=1)
    if grouped:
        return q, k, v
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _mlp_to_megatron(
    arch: HfArch, hf: Mapping[str, torch.Tensor], h: str, m: str, wanted: Container[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, tensor) of one layer's MLP: dense SwiGLU, or router + experts (only the
    `wanted` ones read: an expert-parallel rank holds its own)."""
    if not arch.num_experts:
        fc1 = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
        yield m + "mlp.linear_fc1.weight", fc1
        yield m + "mlp.linear_fc2.weight", hf[h + "mlp.down_proj.weight"]
        return
    yield m + "mlp.router.weight", hf[h + "mlp.gate.weight"]
    for e in range(arch.num_experts):
        src, dst = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
        if dst + "linear_fc1.weight" in wanted:
            fc1 = torch.cat([hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]])
            yield dst + "linear_fc1.weight", fc1
        if dst + "linear_fc2.weight" in wanted:
            yield dst + "linear_fc2.weight", hf[src + "down_proj.weight"]


def hf_to_megatron_layers(
    arch: HfArch, hf: Mapping[str, torch.Tensor], wanted: Container[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsharded) megatron tensors of the decoder from HF tensors, one at a time, each
    read when it is reached (experts by global index); the vocabulary matrices are
    `_copy_vocab_rows`'."""
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield m + "input_layernorm.weight", hf[h + "input_layernorm.weight"]
        att, sa = h + "self_attn.", m + "self_attention."
        for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
            qkv = (hf[att + f"{n}_proj.{kind}"] for n in "qkv")  # (none held once joined)
            yield sa + f"linear_qkv.{kind}", _interleave_qkv(arch, *qkv)
        if arch.qk_norm:
            yield sa + "q_layernorm.weight", hf[att + "q_norm.weight"]
            yield sa + "k_layernorm.weight", hf[att + "k_norm.weight"]
        yield sa + "linear_proj.weight", hf[att + "o_proj.weight"]
        yield m + "pre_mlp_layernorm.weight", hf[h + "post_attention_layernorm.weight"]
        yield from _mlp_to_megatron(arch, hf, h, m, wanted)
    yield "decoder.final_layernorm.weight", hf["model.norm.weight"]


def _mlp_to_hf(arch: HfArch, full: dict[str, torch.Tensor], h: str, m: str) -> Iterator:
    """Inverse of `_mlp_to_megatron` (views of `full`'s tensors)."""
    if not arch.num_experts:
        gate, up = full[m + "mlp.linear_fc1.weight"].chunk(2)
        yield h + "mlp.gate_proj.weight", gate
        yield h + "mlp.up_proj.weight", up
        yield h + "mlp.down_proj.weight", full[m + "mlp.linear_fc2.weight"]
        return
    yield h + "mlp.gate.weight", full[m + "mlp.router.weight"]
    for e in range(arch.num_experts):
        src, dst = f"{m}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}."
        gate, up = full[src + "linear_fc1.weight"].chunk(2)
        yield dst + "gate_proj.weight", gate
        yield dst + "up_proj.weight", up
        yield dst + "down_proj.weight", full[src + "linear_fc2.weight"]


def megatron_full_to_hf(
    arch: HfArch, full: dict[str, torch.Tensor], grouped_qkv: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors from a full megatron state dict (vocab padding removed); views of
    `full`'s tensors where possible. `grouped_qkv`: q, k, v as `_split_qkv(grouped=True)`."""
    vocab = arch.vocab_size
    yield "model.embed_tokens.weight", full["embedding.word_embeddings.weight"][:vocab]
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        att, sa = h + "self_attn.", m + "self_attention."
        yield h + "input_layernorm.weight", full[m + "input_layernorm.weight"]
        for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
            qkv = _split_qkv(arch, full[sa + f"linear_qkv.{kind}"], grouped_qkv)
            yield from ((att + f"{n}_proj.{kind}", t) for n, t in zip("qkv", qkv, strict=True))
        if arch.qk_norm:
            yield att + "q_norm.weight", full[sa + "q_layernorm.weight"]
            yield att + "k_norm.weight", full[sa + "k_layernorm.weight"]
        yield att + "o_proj.weight", full[sa + "linear_proj.weight"]
        yield h + "post_attention_layernorm.weight", full[m + "pre_mlp_layernorm.weight"]
        yield from _mlp_to_hf(arch, full, h, m)
    yield "model.norm.weight", full["decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings:
        yield "lm_head.weight", full["output_layer.weight"][:vocab]


_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _ep() -> tuple[int, int]:
    """(rank, size) in the expert-parallel group."""
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_world_size(),
    )


def global_expert_name(name: str, ep_rank: int, experts_per_rank: int) -> str:
    """`...local_experts.{j}...` of EP rank `ep_rank` -> the same with the global expert index."""
    return _LOCAL_EXPERT.sub(
        lambda mt: f".local_experts.{ep_rank * experts_per_rank + int(mt.group(1))}.", name
    )


def _shard_dim(name: str) -> int | None:
    """TP split dim of a megatron parameter; None = replicated."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if "layernorm" in name or name.endswith("router.weight"):
        return None
    return 0


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's TP slice. fc1 holds `[gate_shard; up_shard]`; qkv splits whole query groups."""
    dim = _shard_dim(name)
    if size == 1 or dim is None:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return full.chunk(size, dim=dim)[rank]


def unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard` given every rank's slice in rank order."""
    dim = _shard_dim(name)
    if len(pieces) == 1 or dim is None:
        return pieces[0]
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(pieces, dim=dim)


def load_hf_state(model_dir: str | Path, flag: str = "--model") -> HfState:
    """The tensors of the safetensors weight files of a HF directory (`weight_files`), each
    read when looked up; errors name `flag`, the file or the tensor."""
    return HfState(model_dir, flag)


def load_hf_into_model(model: GPTModel, arch: HfArch, hf: Mapping[str, torch.Tensor]) -> None:
    """Copy HF weights into this rank's shard of `model` (any TP and EP size) a tensor at a
    time: beyond the model, the memory of one layer's tensors (an `HfState` reads each when it
    is reached). Checks every name and shape; ValueError naming `hf`'s folder when the weights
    are not the architecture's."""
    rank, size = _tp()
    ep_rank, ep_size = _ep()
    per_rank = arch.num_experts // ep_size
    params = {global_expert_name(n, ep_rank, per_rank): p for n, p in expert_views(model)}
    vocab = {"embedding.word_embeddings.weight": "model.embed_tokens.weight"}
    if not arch.tie_word_embeddings:
        vocab["output_layer.weight"] = "lm_head.weight"
    with torch.no_grad():
        try:
            for name, hf_name in vocab.items():
                _copy_vocab_rows(hf, hf_name, params.pop(name), arch.vocab_size, rank)
            for name, full in hf_to_megatron_layers(arch, hf, set(params)):
                part = shard(name, full, rank, size)
                if name in params and part.shape != params[name].shape:
                    raise RuntimeError(
                        f"{name}: {list(part.shape)}, wanted {list(params[name].shape)}"
                    )
                params.pop(name).copy_(part)
        except RuntimeError as exc:  # (shapes that do not fit: another model's weights)
            raise ValueError(
                f"{getattr(hf, 'folder', 'the HF weights')}: the weights do not fit the "
                f"architecture of its config.json ({exc}): do they belong together?"
            ) from None
    if params:
        raise KeyError(f"HF checkpoint lacks tensors for {sorted(params)[:5]}")


def _copy_vocab_rows(
    hf: Mapping[str, torch.Tensor], name: str, param: torch.Tensor, vocab: int, rank: int
) -> None:
    """This TP rank's rows of a vocabulary matrix (padded beyond `vocab` with zeros): read
    straight into the parameter from an `HfState` (no copy of a matrix that may be a tenth of
    the model), else copied from `hf[name]`."""
    first, wanted = rank * param.shape[0], (vocab, *param.shape[1:])
    rows = max(0, min(param.shape[0], vocab - first))
    if isinstance(hf, HfState) and name not in hf.held and name in hf.entries:
        if tuple(shape := hf.entries[name].shape) != wanted:
            raise RuntimeError(f"{name}: {list(shape)}, wanted {list(wanted)}")
        # (a GPU parameter: through the copy below; file reads land in host memory only)
        if param.dtype == hf.entries[name].dtype and param.device.type == "cpu":
            if rows:  # (a last TP rank may hold padding only)
                hf.read_into(name, param[:rows], first_row=first)
            param[rows:].zero_()
            return
    source = hf[name]
    if tuple(source.shape) != wanted:
        raise RuntimeError(f"{name}: {list(source.shape)}, wanted {list(wanted)}")
    param[:rows].copy_(source[first : first + rows])
    param[rows:].zero_()


# Parameters by module, kept while the module lives (an optimizer step changes their data,
# never the Parameter objects).
_named_parameters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# On-device exports by module (TP = 1), see `_DeviceExport`.
_device_exports: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _dense(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` in `dtype`, contiguous; each conversion only when needed (thousands of tensors)."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


class _DeviceExport:
    """A TP = 1 model's HF-named tensors on its device, built once and refreshed per export.

    A tensor that is a contiguous slice of a parameter in the wanted dtype (the projections,
    norms, fc1's gate and up halves, the embedding without its vocab padding) is a view of the
    parameter and always current. q, k and v are strided slices of the interleaved
    `linear_qkv`: each layer gets one buffer holding its q, k and v back to back (HF layout),
    refreshed by one row gather. Anything in another dtype gets a buffer refreshed by a copy.
    So an export costs a few hundred kernel launches instead of thousands of tensor
    operations, and returns the same tensor objects each time (the NCCL sender reuses its
    layout for them). Valid while every parameter keeps its storage (checked at each export;
    rebuilt otherwise). Memory: the buffers, about a sixth of a Llama's weights (q, k, v)."""

    def __init__(self, params: list[tuple[str, torch.Tensor]], arch: HfArch, dtype) -> None:  # type: ignore[no-untyped-def]
        self.dtype = dtype
        self.storage = [(p, p.data_ptr()) for _, p in params]
        full = {name: param.detach() for name, param in params}
        storages = {p.untyped_storage().data_ptr() for _, p in params}
        self.named: list[tuple[str, torch.Tensor]] = []
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, source) pairs
        self.gathers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, linear_qkv)
        self.rows: torch.Tensor | None = None  # linear_qkv's row of each HF q, k, v row
        self.graph: torch.cuda.CUDAGraph | None = None  # `refresh` captured (CUDA)
        qkv: dict[str, torch.Tensor] = {}
        for name, view in megatron_full_to_hf(arch, full, grouped_qkv=True):
            if view.untyped_storage().data_ptr() not in storages:  # a copy would go stale
                raise AssertionError(f"{name} is not a view of a parameter")
            proj = name.split(".")[-2]
            if proj in ("q_proj", "k_proj", "v_proj") and dtype in (None, view.dtype):
                if proj == "q_proj":  # first of the three: the layer's buffer
                    layer, kind = name.split(".")[2], name.split(".")[-1]
                    source = full[f"decoder.layers.{layer}.self_attention.linear_qkv.{kind}"]
                    qkv = self._gather_into(arch, source)
                self.named.append((name, qkv[proj]))
            elif view.is_contiguous() and dtype in (None, view.dtype):
                self.named.append((name, view))
            else:
                shape = tuple(view.shape)
                if proj in ("q_proj", "k_proj", "v_proj"):
                    shape = (view.shape[0] * view.shape[1], *view.shape[2:])  # HF rows
                buffer = torch.empty(shape, dtype=dtype or view.dtype, device=view.device)
                self.copies.append((buffer.view(view.shape), view))
                self.named.append((name, buffer))

    def _gather_into(self, arch: HfArch, source: torch.Tensor) -> dict[str, torch.Tensor]:
        """A buffer for one layer's q, k, v (HF rows, back to back) filled from `source`."""
        ng, hn = arch.num_kv_heads, arch.head_dim
        per = arch.num_heads // ng
        if self.rows is None:
            rows = torch.arange(ng * (per + 2) * hn, device=source.device).view(ng, per + 2, hn)
            self.rows = torch.cat(
                [rows[:, :per].reshape(-1), rows[:, per].reshape(-1), rows[:, per + 1].reshape(-1)]
            )
        buffer = torch.empty_like(source)
        self.gathers.append((buffer, source))
        q, k, v = torch.split(buffer, [ng * per * hn, ng * hn, ng * hn])
        return {"q_proj": q, "k_proj": k, "v_proj": v}

    def valid(self, dtype: torch.dtype | None) -> bool:
        return dtype == self.dtype and all(p.data_ptr() == ptr for p, ptr in self.storage)

    @torch.no_grad()
    def refresh(self) -> list[tuple[str, torch.Tensor]]:
        """Bring the buffers up to date. On CUDA, the gathers and copies are captured once
        into a CUDA graph (their addresses never change while `valid`), so a refresh is one
        launch instead of hundreds, ~1.5 ms less host time before each weight sync."""
        if self.graph is not None:
            self.graph.replay()
            return self.named
        self._run()
        if self.graph is None and self.rows is not None and self.rows.is_cuda:
            self.graph = self._capture()
        return self.named

    def _run(self) -> None:
        for buffer, source in self.gathers:
            torch.index_select(source, 0, self.rows, out=buffer)
        for buffer, source in self.copies:
            buffer.copy_(source)

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # capture wants its kernels run once off-graph
                self._run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._run()
            return graph
        except RuntimeError as exc:  # e.g. a driver without graph support: stay eager
            log.warning("export refresh stays eager (CUDA graph capture failed: %s)", exc)
            return None


def export_hf(
    model: GPTModel, arch: HfArch, dtype: torch.dtype | None = None, on_device: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """HF-named full tensors of `model`, gathered over TP and, for MoE experts, over EP (every
    rank of those groups returns the same).

    By default they are CPU copies, safe to keep while training goes on. With `on_device` they
    stay where the model is (a GPU for NCCL broadcast: no round trip through host memory) and
    may share storage with the parameters: use them before the next optimizer step. At TP = EP
    = 1 an on-device export returns the same tensors at every call, refreshed (`_DeviceExport`)."""
    _, size = _tp()
    _, ep_size = _ep()
    full: dict[str, torch.Tensor] = {}
    group = parallel_state.get_tensor_model_parallel_group() if size > 1 else None
    if model not in _named_parameters:  # the walk over megatron's module tree costs ms
        _named_parameters[model] = list(expert_views(model))
    if on_device and size == 1 and ep_size == 1:
        cached = _device_exports.get(model)
        if cached is None or not cached.valid(dtype):
            cached = _device_exports[model] = _DeviceExport(_named_parameters[model], arch, dtype)
        return cached.refresh()
    for name, param in _named_parameters[model]:
        local = param.detach()
        if size > 1 and _shard_dim(name) is not None:
            pieces = [torch.empty_like(local) for _ in range(size)]
            torch.distributed.all_gather(pieces, local.contiguous(), group=group)
            local = unshard(name, pieces)
        if ep_size > 1 and ".local_experts." in name:
            full.update(_gather_experts(name, local, arch.num_experts // ep_size))
        else:
            full[name] = local
    if on_device:
        return [(n, _dense(t, dtype)) for n, t in megatron_full_to_hf(arch, full)]
    return [
        (n, t.to(dtype or t.dtype).contiguous().cpu().clone())
        for n, t in megatron_full_to_hf(arch, full)
    ]


def _gather_experts(name: str, local: torch.Tensor, per_rank: int) -> dict[str, torch.Tensor]:
    """Every EP rank's copy of local expert `name`, under its global expert names."""
    group = parallel_state.get_expert_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, local.contiguous(), group=group)
    return {global_expert_name(name, r, per_rank): t for r, t in enumerate(pieces)}
