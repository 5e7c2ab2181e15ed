"""The megatron side of the trainer: process groups, model, optimizer, and the two passes.

`Policy` owns a megatron `GPTModel` wrapped in megatron DDP, a megatron optimizer and LR
scheduler. `logprobs()` is a forward-only pass through `get_forward_backward_func`; `train_step()`
runs forward+backward over micro-batches with the RL loss and steps the optimizer. Log-probs are
computed vocab-parallel (the logits of a TP rank cover only its vocabulary slice), with the
padded vocabulary rows masked out so they take no probability mass.

Does not know Redis, ZMQ or the sample format (`batching.MicroBatch` is its input).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from services.trainer import cpu_compat, hf_convert, routing_replay
from services.trainer.batching import MicroBatch
from services.trainer.config import TrainerConfig
from services.trainer.stats import comm_device

PAD_LOGIT = -1e30  # finite: exp() gives 0 and 0 * PAD_LOGIT stays 0 in the entropy


def init_distributed(tp_size: int, seed: int, ep_size: int = 1) -> None:
    """gloo (CPU) or NCCL process group; a world of one when not started by torchrun."""
    cpu_compat.install()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # Ranks > 0 wait in a broadcast while rank 0 waits for samples from Redis, which may take
        # long (rollouts stalled, router restarting): a generous timeout, not gloo's 30 min.
        timeout = timedelta(hours=24)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:  # single process: an in-memory store, no port to pick
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size, expert_model_parallel_size=ep_size
        )
    seed_model_parallel(seed)


def seed_model_parallel(seed: int) -> None:
    """Seed every RNG; the inference tracker's `fork()` needs no CUDA (cpu_compat reason 2)."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    with_entropy: bool,
    entropy_grad: bool = True,
    temperature: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and entropy from this TP rank's vocab slice of `logits` ([..., V/tp]).
    Without `entropy_grad` the entropy is a metric: computed outside autograd.

    `temperature` (`[...]`, each position's sample's; None = 1): the logits are divided by it
    before everything, as the engine's reported log-probs are `log_softmax(logits / T)`. So
    the log-probs, the ratios and KL terms built on them and the entropy are all of the
    tempered distribution the samples were drawn from (slime does the same)."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    local_v = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local_v
    scaled = logits.float()
    if temperature is not None:  # (bf16 logits: in place on float()'s copy, one [.., V] less)
        t = temperature.to(scaled.device).unsqueeze(-1)
        scaled = scaled / t if scaled is logits else scaled.div_(t)
    logits = scaled
    vocab_ids = torch.arange(start, start + local_v, device=logits.device)
    if start + local_v > vocab_size:
        logits = logits.masked_fill(vocab_ids >= vocab_size, PAD_LOGIT)
    top = logits.detach().max(-1).values
    if tp_size > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    sum_exp = shifted.exp().sum(-1)
    in_slice = (targets >= start) & (targets < start + local_v)
    local_t = (targets - start).clamp(0, local_v - 1)
    picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * in_slice
    if tp_size > 1:
        sum_exp = dist.nn.functional.all_reduce(sum_exp, group=group)
        picked = dist.nn.functional.all_reduce(picked, group=group)
    lse = sum_exp.log()
    logp = picked - lse
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.exp(shifted - lse.unsqueeze(-1))
        expected = (probs * shifted).sum(-1)
        if tp_size > 1:
            expected = dist.nn.functional.all_reduce(expected, group=group)
        return logp, lse - expected


LossFn = Callable[
    [MicroBatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, dict]
]


class Policy:
    """Model + optimizer + scheduler on this rank; call `init_distributed` first."""

    def __init__(
        self,
        cfg: TrainerConfig,
        model_dir: str,
        train: bool = True,
        arch: hf_convert.HfArch | None = None,
        value_head: bool = False,
    ) -> None:
        """Weights from the HF `model_dir`; or, given `arch` (benchmarks), random ones.

        `value_head`: a critic. The output layer is untied and zeroed, and its first row is the
        value head: loss functions receive `logits[..., 0]` (values start at 0) instead of
        log-probs. Tensor parallelism 1 only (the row lives on rank 0).
        """
        self.cfg = cfg
        self.value_head = value_head
        # Told when a phase of `train_step` ends (the trainer's step clock and timeline).
        self.on_phase: Callable[[str], None] = lambda _phase: None
        self.arch = arch or hf_convert.read_hf_arch(model_dir)
        self.hf_config_json = "" if arch else (Path(model_dir) / "config.json").read_text()
        if value_head:
            self.arch = replace(self.arch, tie_word_embeddings=False)
        tf_config = hf_convert.transformer_config(
            self.arch,
            cfg.model.tensor_model_parallel_size,
            cfg.model.bf16,
            cfg.model.expert_model_parallel_size,
            cfg.model.moe_aux_loss_coeff,
            cfg.model.use_routing_replay and self.arch.num_experts > 0,
            cfg.model.moe_grouped_experts,
        )
        # The loss returns (numerator, denominator), summed by megatron and divided once.
        tf_config.calculate_per_token_loss = True
        self.model = hf_convert.build_gpt_model(
            self.arch, tf_config, cfg.model.make_vocab_size_divisible_by
        )
        if arch is None:
            hf_state = hf_convert.load_hf_state(model_dir)
            if value_head:
                hf_state["lm_head.weight"] = torch.zeros_like(hf_state["model.embed_tokens.weight"])
            hf_convert.load_hf_into_model(self.model, self.arch, hf_state)
        if torch.cuda.is_available():
            self.model.cuda()
        self.replays = routing_replay.routers(self.model)  # empty unless --use-routing-replay
        self.train_enabled = train
        if not train:
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
            self.chunks: list[Any] = [self.model]
            return
        self.ddp = DistributedDataParallel(
            config=tf_config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            module=self.model,
        )
        tf_config.finalize_model_grads_func = finalize_model_grads
        tf_config.no_sync_func = self.ddp.no_sync
        self.chunks = [self.ddp]
        self.optimizer, self.scheduler = _optimizer_and_scheduler(cfg, tf_config, self.chunks)

    # --- passes -------------------------------------------------------------------------------

    def _forward(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        """`mb` on the model's device (`_run` moves every micro-batch there first)."""
        if self.replays:
            routing_replay.apply(self.replays, mb.routed_experts)
        return model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            attention_mask=None,
            packed_seq_params=mb.packed_seq_params,
        )

    def _run(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        forward_only: bool,
        with_entropy: bool,
        entropy_grad: bool = True,
    ) -> list[dict]:
        def step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            logits = self._forward(model, mb)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                if self.value_head:
                    return loss_fn(mb, output[..., 0].float(), None)
                logp, entropy = token_logprobs(
                    output,
                    mb.targets,
                    self.arch.vocab_size,
                    with_entropy,
                    entropy_grad,
                    mb.temperature,
                )
                return loss_fn(mb, logp, entropy)

            return logits, loss_func

        max_len = max(int(mb.input_ids.shape[1]) for mb in micro_batches)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([mb.to(dev) for mb in micro_batches]),
            model=self.chunks,
            num_microbatches=len(micro_batches),
            seq_length=max_len,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch], with_entropy: bool = False) -> list[dict]:
        """Forward-only: per micro-batch {"logp": [rows, S], "entropy": [rows, S] or absent}."""
        for c in self.chunks:
            c.eval()

        def collect(mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None):  # type: ignore[no-untyped-def]
            out = {"logp": logp.detach()}
            if ent is not None:
                out["entropy"] = ent.detach()
            # (on the device: megatron keeps the first loss scale it sees for the MoE aux loss
            # and copies each later one into it, a host sync per micro-batch were it on the host)
            zero = torch.zeros((), device=logp.device)
            return zero, torch.ones((), dtype=torch.int, device=logp.device), out

        return self._run(micro_batches, collect, forward_only=True, with_entropy=with_entropy)

    def train_step(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        with_entropy: bool,
        entropy_grad: bool = True,
    ) -> tuple[list[dict], bool, float]:
        """Forward+backward over all micro-batches, then one optimizer step. The loss gets
        each micro-batch's entropy `with_entropy`, differentiable if `entropy_grad`.

        Returns (per-micro-batch loss dicts, whether the update was applied, grad norm). A
        non-finite gradient norm skips the update (the caller counts or fails).
        """
        for c in self.chunks:
            c.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = self._run(micro_batches, loss_fn, False, with_entropy, entropy_grad)
        grad_norm = self._global_grad_norm()
        self.on_phase("forward_backward")
        if not torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.zero_grad()
            return stats, False, grad_norm
        applied, _, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        return stats, bool(applied), grad_norm

    def _global_grad_norm(self) -> float:
        """L2 norm of all gradients (before clipping), over TP ranks; grads are DP-reduced."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [getattr(p, "main_grad", None) for p in params]
        sq = torch.zeros((), dtype=torch.float32, device=comm_device())
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            # TP-replicated parameters (norms) would be counted tp times: count them on rank 0.
            replicated = not getattr(p, "tensor_model_parallel", False)
            if replicated and parallel_state.get_tensor_model_parallel_rank() > 0:
                continue
            sq = sq + g.float().square().sum().to(sq.device)
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
        return float(sq.sqrt())

    def export_hf(self, on_device: bool = False) -> list[tuple[str, torch.Tensor]]:
        """Current weights, HF names, full (TP-gathered) tensors (see hf_convert.export_hf)."""
        return hf_convert.export_hf(self.model, self.arch, on_device=on_device)


def _optimizer_and_scheduler(
    cfg: TrainerConfig, tf_config: Any, chunks: list[Any]
) -> tuple[Any, Any]:
    """megatron AdamW (non-distributed: its checkpoint reshards on CPU too) and LR schedule."""
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.optimizer.lr,
            min_lr=cfg.optimizer.min_lr,
            weight_decay=cfg.optimizer.weight_decay,
            adam_beta1=cfg.optimizer.adam_beta1,
            adam_beta2=cfg.optimizer.adam_beta2,
            adam_eps=cfg.optimizer.adam_eps,
            clip_grad=cfg.optimizer.clip_grad,
            bf16=cfg.model.bf16,
            params_dtype=tf_config.params_dtype,
        ),
        chunks,
    )
    decay_steps = cfg.optimizer.lr_decay_iters or max(cfg.batch.max_steps, 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.optimizer.lr_warmup_iters else cfg.optimizer.lr,
        max_lr=cfg.optimizer.lr,
        min_lr=cfg.optimizer.min_lr,
        lr_warmup_steps=cfg.optimizer.lr_warmup_iters,
        lr_decay_steps=max(decay_steps, cfg.optimizer.lr_warmup_iters + 1),
        lr_decay_style=cfg.optimizer.lr_decay_style,
        start_wd=cfg.optimizer.weight_decay,
        end_wd=cfg.optimizer.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
