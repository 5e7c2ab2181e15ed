"""Run megatron-core 0.16.1 on a machine without CUDA. A no-op when CUDA is available.

megatron-core assumes a GPU in a few places. Each reason, and what `install()` does about it:

1. `rotary_pos_embedding` places `inv_freq` on `torch.cuda.current_device()`; the dist
   checkpoint savers build flag tensors there too, and so do the sequence-parallel collectives
   (the MoE token dispatcher) in their backward, which runs inside `torch.autograd.backward`
   where the function mode below is off (a mode is popped while it handles a call).
   -> `torch.cuda.current_device` returns the CPU device, usable with or without the mode (a
   device index given to a tensor factory or `Tensor.to` is mapped to CPU by the mode).
2. The CUDA RNG tracker (`tensor_parallel.random`) forks CUDA RNG states.
   -> not patched: callers use `model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True,
   force_reset_rng=True)`, the official option whose tracker `fork()` is a no-op
   (`seed_model_parallel` in `megatron_setup.py`).
3. `fused_softmax.get_default_causal_mask`, `forward_backward_no_pipelining` (token counter),
   `FP32Optimizer` / `MixedPrecisionOptimizer` (found-inf flag, loss scale) and `clip_grads`
   (norm buffers) create tensors with `device="cuda"`.
   -> a `TorchFunctionMode`, pushed once for the process, rewrites a CUDA `device` argument
   of any torch function or tensor method to CPU.
4. `clip_grads.clip_grad_by_total_norm_fp32` asserts `param.grad.type() ==
   'torch.cuda.FloatTensor'`, and the bf16 optimizer checks `param.type()` for CUDA names.
   -> the same mode answers the no-argument `Tensor.type()` with the CUDA spelling of a CPU
   tensor's type.
5. `dist_checkpointing` calls `torch.cuda.synchronize()` around saves.
   -> `torch.cuda.synchronize` becomes a no-op.

What this module does not do: make anything fast, or emulate CUDA semantics beyond placing
tensors on CPU. Import order does not matter: megatron reads these at call time.

One thing it does at import time, `import_megatron()` (the trainer's and `tandem convert`'s first
import of megatron-core): without fused kernels (`fused_kernels_enabled`: no CUDA, or
TANDEM_COMPILE=0) megatron's `jit_fuser` functions stay eager, as this trainer's own fusions do,
instead of being wrapped by `torch.compile` at import (which imports torch's compiler stack:
~2.3 s of CPU a process) and compiled by a C++ compiler at their first call; and the optional
`wandb` that megatron's inference code imports when installed (~1 s; the trainer logs nothing
to W&B) is not imported.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_installed: _CudaToCpuMode | None = None
_originals: dict[str, Any] = {}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Reasons 1, 3, 4: device arguments that name CUDA go to CPU; `Tensor.type()` says cuda."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func in (torch.Tensor.to, torch.Tensor.cuda) and args:
            if func is torch.Tensor.cuda:
                return args[0]
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


def install() -> bool:
    """Apply the cures above once per process; returns True when they were needed."""
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed is None:
        _originals.update(
            current_device=torch.cuda.current_device, synchronize=torch.cuda.synchronize
        )
        torch.cuda.current_device = lambda: torch.device("cpu")  # reason 1
        torch.cuda.synchronize = lambda device=None: None  # reason 5
        # Pushed for the rest of the process: megatron creates CUDA tensors at arbitrary times.
        _installed = _CudaToCpuMode()
        _installed.__enter__()
    return True


def uninstall() -> None:
    """Undo `install()` (for test processes that run other code afterwards)."""
    global _installed
    if _installed is None:
        return
    _installed.__exit__(None, None, None)
    torch.cuda.current_device = _originals["current_device"]
    torch.cuda.synchronize = _originals["synchronize"]
    _installed = None


def fused_kernels_enabled() -> bool:
    """Whether to compile fused elementwise kernels (RoPE, megatron's SwiGLU and its other
    `jit_fuser` functions): on CUDA, unless `TANDEM_COMPILE=0`. CPU runs stay eager (no
    compiler needed, quick to start)."""
    return torch.cuda.is_available() and os.environ.get("TANDEM_COMPILE", "1") != "0"


def fused(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` compiled into fused kernels for CUDA tensors when `fused_kernels_enabled()`
    (compiled at the first such call, any length: `dynamic=True`); eager otherwise, and for
    good if this machine cannot compile (said once in the log)."""
    compiled: list[Any] = []

    def call(first: torch.Tensor, *rest: Any) -> torch.Tensor:
        if not first.is_cuda or not fused_kernels_enabled() or compiled == [None]:
            return fn(first, *rest)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        try:
            return compiled[0](first, *rest)
        except Exception as exc:  # no working compiler here: stay correct, only slower
            logging.getLogger(__name__).warning("fused %s unavailable (%s)", fn.__name__, exc)
            compiled[0] = None
            return fn(first, *rest)

    return call


def import_megatron() -> None:
    """Import megatron-core, its `jit_fuser` eager and without wandb when fused kernels are off
    (see the module docstring); before any other import of it in the process, else a no-op."""
    if "megatron.core" in sys.modules or fused_kernels_enabled():
        import megatron.core

        return
    compile_, had_wandb = torch.compile, "wandb" in sys.modules
    torch.compile = _eager  # type: ignore[assignment]
    sys.modules.setdefault("wandb", None)  # type: ignore[arg-type]  # (its import: ImportError)
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_
        if not had_wandb:
            del sys.modules["wandb"]


def _eager(model: Any = None, **_options: Any) -> Any:
    """`torch.compile` as megatron's `jit_fuser` uses it, compiling nothing."""
    return model if model is not None else _eager
