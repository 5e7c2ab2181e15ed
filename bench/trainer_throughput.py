"""Trainer throughput: packed (THD, token budget) vs right-padded micro-batches, same model, same run.

One "step" is what the trainer does per optimizer step: forward+backward with the RL loss and
an AdamW step (with `--recompute-logprobs always`, a forward-only pass for the proximal
log-probs before it). Samples have a fixed prompt length
and long-tailed (log-normal) response lengths. Throughput counts real tokens only.

CPU (default: the toy-sized model):
    python bench/trainer_throughput.py
GPU, ~1B model (16 layers, hidden 2048), bf16:
    python bench/trainer_throughput.py --device cuda --bf16 --hidden-size 2048 --num-layers 16 \
        --num-heads 16 --num-kv-heads 8 --ffn-hidden-size 5632 --vocab-size 32000 \
        --num-samples 256 --prompt-len 128 --mean-response-len 512 --max-response-len 4096 \
        --max-tokens-per-gpu 16384 --micro-batch-size 4
Last line: `packed_vs_padded_tokens_per_s: RATIO`.

MoE (Qwen3-MoE shape: top-k softmax router, SwiGLU experts, no shared expert) with
`--num-experts E --moe-topk K --moe-ffn-hidden-size F`; `--dense-baseline` then also times, in
the same run, the dense model of the same active size (FFN width K x F). Model FLOPs and MFU
count ACTIVE parameters (each token runs K of the E experts), by the 6 * N_active * tokens
rule. A ~1.1B-active Qwen3-MoE (3.5B total) against its dense twin, on one H200:
    python bench/trainer_throughput.py --device cuda --bf16 --hidden-size 2048 --num-layers 16 \
        --num-heads 16 --num-kv-heads 4 --head-dim 128 --vocab-size 32000 \
        --num-experts 32 --moe-topk 8 --moe-ffn-hidden-size 1024 --dense-baseline \
        --num-samples 128 --prompt-len 128 --mean-response-len 512 --max-response-len 2048 \
        --max-tokens-per-gpu 8192 --modes packed
(about 63 GB of weights, gradients and AdamW state for the MoE, plus the dispatched tokens'
activations: an H200; each model runs after the last one's memory is released.) An MoE runs
twice, with megatron's `SequentialMLP` experts (`[moe_sequential]`) and with the grouped-GEMM
experts (`[moe_grouped]`, the trainer's default); `--experts` picks one. Last line:
`grouped_vs_sequential_tokens_per_s: RATIO`.

Layer only (`--layer-only`): the experts module alone, forward+backward over tokens already
grouped by expert, at Qwen3-30B-A3B's expert shape by default (hidden 2048, expert width 768,
128 experts, top-8, 32k tokens), against the bare `torch._grouped_mm` calls of the same
products on the same tensors (the kernel's ceiling: two forward, four backward GEMMs):
    python bench/trainer_throughput.py --device cuda --layer-only
Last line: `module_vs_bare_grouped_mm: RATIO`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 weights (fp32 master); default fp32")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--ffn-hidden-size", type=int, default=192)
    p.add_argument("--head-dim", type=int, default=0, help="0 = hidden size / heads")
    p.add_argument("--num-experts", type=int, default=0, help="> 0: a Qwen3-MoE of this many")
    p.add_argument("--moe-topk", type=int, default=2, help="experts per token (MoE)")
    p.add_argument("--moe-ffn-hidden-size", type=int, default=64, help="FFN width of one expert")
    p.add_argument(
        "--dense-baseline",
        action="store_true",
        help="MoE: also time the dense model of the same active size (FFN topk x expert width)",
    )
    p.add_argument(
        "--experts",
        choices=["both", "grouped", "sequential"],
        default="both",
        help="MoE: which experts to time (both: SequentialMLP, then grouped GEMMs)",
    )
    p.add_argument(
        "--dispatcher",
        choices=["trainer", "megatron"],
        default="trainer",
        help="MoE: the trainer's token dispatch (no host syncs where it applies: "
        "services/trainer/expert_dispatch.py) or megatron's own dispatcher, for comparison",
    )
    add_layer_args(p)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--num-samples", type=int, default=128, help="samples per step")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--mean-response-len", type=int, default=48, help="median of the log-normal")
    p.add_argument("--response-len-sigma", type=float, default=1.0, help="log-normal sigma (tail)")
    p.add_argument("--max-response-len", type=int, default=512)
    p.add_argument("--max-tokens-per-gpu", type=int, default=2048, help="packed token budget")
    p.add_argument("--micro-batch-size", type=int, default=8, help="padded samples per micro-batch")
    p.add_argument("--iters", type=int, default=3, help="timed steps per mode (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--recompute-logprobs",
        choices=["auto", "always"],
        default="auto",
        help="the trainer's option: a separate forward pass for the proximal log-probs (always) "
        "or the training forward's own (auto)",
    )
    p.add_argument("--modes", nargs="+", choices=["packed", "padded"], default=["packed", "padded"])
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile one packed step and print the N costliest kernels",
    )
    return p.parse_args(argv)


def add_layer_args(p: argparse.ArgumentParser) -> None:
    """`--layer-only` and the shape of its experts layer."""
    p.add_argument(
        "--layer-only",
        action="store_true",
        help="time the experts module alone against bare torch._grouped_mm (bf16 on CUDA); "
        "its shape: --layer-hidden, --layer-ffn, --layer-experts, --layer-topk, --layer-tokens",
    )
    p.add_argument(
        "--curve",
        type=int,
        default=0,
        metavar="N",
        help="MoE: N optimizer steps of SequentialMLP and grouped experts from the same "
        "weights on the same micro-batches; the loss and gradient norm of each step",
    )
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate of --curve")
    p.add_argument("--layer-hidden", type=int, default=2048)
    p.add_argument("--layer-ffn", type=int, default=768)
    p.add_argument("--layer-experts", type=int, default=128)
    p.add_argument("--layer-topk", type=int, default=8)
    p.add_argument("--layer-tokens", type=int, default=32768)


def make_samples(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from services.trainer.batching import TrainSample

    rng = random.Random(args.seed)
    samples = []
    for _ in range(args.num_samples):
        n = int(
            min(
                args.max_response_len,
                max(1, rng.lognormvariate(0, args.response_len_sigma) * args.mean_response_len),
            )
        )
        tokens = [rng.randrange(args.vocab_size) for _ in range(args.prompt_len + n)]
        samples.append(
            TrainSample(
                tokens=tokens,
                prompt_len=args.prompt_len,
                behaviour_logp=[-2.0] * n,
                loss_mask=[1] * n,
                advantages=[rng.gauss(0, 1)] * n,
                weight_version=0,
                reward=0.0,
            )
        )
    return samples


def one_step(policy, cfg, samples, packed: bool) -> list:  # type: ignore[no-untyped-def]
    """What the trainer does per step: with `--recompute-logprobs always` a forward-only pass
    for the proximal log-probs first; then forward+backward with the RL loss (and the mismatch
    and entropy metrics) and an optimizer step. Returns the micro-batches."""
    from services.trainer import batching, losses, step_math
    from services.trainer.stats import StepStats

    mbs = batching.make_micro_batches(
        samples, packed, cfg.batch.max_tokens_per_gpu, cfg.batch.micro_batch_size
    )
    stats = StepStats()
    recompute = cfg.loss.recompute_logprobs == "always"
    if recompute:
        for mb, out in zip(mbs, policy.logprobs(mbs, with_entropy=True), strict=True):
            mb.proximal_logp, mb.entropy = out["logp"], out["entropy"]
        step_math.mismatch_stats(mbs, samples, 0, stats)
    loss_fn = step_math.LossFunction(
        cfg, losses.PolicyLossConfig(), 1, stats, samples=None if recompute else samples
    )
    policy.train_step(mbs, loss_fn, with_entropy=True, entropy_grad=False)
    stats.sums  # noqa: B018 -- the metrics are read every step, as the trainer does
    return mbs


def run_mode(policy, cfg, samples, packed: bool, iters: int, sync) -> dict[str, float]:  # type: ignore[no-untyped-def]
    times, tokens, n_mbs, occupied = [], 0, 0, 0
    for i in range(iters + 1):
        sync()
        t0 = time.perf_counter()
        mbs = one_step(policy, cfg, samples, packed)
        sync()
        if i:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - t0)
        tokens = sum(mb.num_tokens for mb in mbs)
        n_mbs = len(mbs)
        occupied = (
            len(mbs) * cfg.batch.max_tokens_per_gpu
            if packed
            else sum(mb.input_ids.numel() for mb in mbs)
        )
    median = sorted(times)[len(times) // 2]
    return {
        "step_s": median,
        "tokens_per_s": tokens / median,
        "micro_batches": n_mbs,
        "efficiency": tokens / occupied,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the trainer picks CUDA whenever it sees one
    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.policy import Policy, init_distributed

    torch.set_num_threads(args.threads)
    init_distributed(tp_size=1, seed=args.seed)
    if args.dispatcher == "megatron":
        from services.trainer import expert_dispatch

        expert_dispatch.applies = lambda _config: False  # every MoE layer keeps megatron's
    if args.layer_only:
        return layer_only(args)
    if args.curve:
        return loss_curve(args)
    samples = make_samples(args)
    lengths = sorted(len(s.tokens) - args.prompt_len for s in samples)
    print(
        f"device {args.device} samples {len(samples)} response len p50 "
        f"{lengths[len(lengths) // 2]} p90 {lengths[int(len(lengths) * 0.9)]} max {lengths[-1]}",
        flush=True,
    )
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    peak = matmul_peak_tflops() if args.device == "cuda" else 0.0
    if peak:
        print(f"bf16 matmul peak (8192^3, random data, this GPU, now): {peak:.0f} TFLOP/s")
    results = {}
    for label, arch, grouped in models(args):
        cfg = TrainerConfig(
            model="(random)",
            bf16=args.bf16,
            max_tokens_per_gpu=args.max_tokens_per_gpu,
            micro_batch_size=args.micro_batch_size,
            recompute_logprobs=args.recompute_logprobs,
            moe_grouped_experts=grouped,
        )
        policy = Policy(cfg, "", arch=arch)
        total, active = parameter_counts(policy.model, arch)
        print(f"[{label}] params {total / 1e6:.1f}M, active {active / 1e6:.1f}M", flush=True)
        results[label] = bench_model(args, label, policy, cfg, samples, active, peak, sync)
        del policy  # release one model before the next is built
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if "moe_grouped" in results:
        summary(args, results)
    return 0


def models(args: argparse.Namespace) -> list:  # type: ignore[type-arg]
    """(label, arch, grouped experts) of each model to time, in order."""
    if not args.num_experts:
        return [("dense", make_arch(args, moe=False), True)]
    kinds = {"both": (False, True), "grouped": (True,), "sequential": (False,)}[args.experts]
    out = [(f"moe_{'grouped' if g else 'sequential'}", make_arch(args, moe=True), g) for g in kinds]
    if args.dense_baseline:
        out.append(("dense_same_active", make_arch(args, moe=False), True))
    return out


def summary(args: argparse.Namespace, results: dict) -> None:  # type: ignore[type-arg]
    """The grouped MoE's tokens/s and MFU against the other models of the run."""
    mode = args.modes[0]
    grouped = results["moe_grouped"][mode]
    for label in ("dense_same_active", "moe_sequential"):
        if label in results:
            other = results[label][mode]
            name = "dense" if label.startswith("dense") else "sequential"
            if grouped.get("mfu") and other.get("mfu"):
                print(f"grouped_vs_{name}_mfu: {grouped['mfu'] / other['mfu']:.2f}")
            ratio = grouped["tokens_per_s"] / other["tokens_per_s"]
            print(f"grouped_vs_{name}_tokens_per_s: {ratio:.2f}", flush=True)


def layer_only(args: argparse.Namespace) -> int:
    """One `GroupedExperts` layer, forward+backward, against the bare grouped GEMMs."""
    import torch
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from services.trainer.grouped_experts import GroupedExperts
    from services.trainer.hf_convert import transformer_config

    arch = dataclasses.replace(
        make_arch(args, moe=True),
        hidden_size=args.layer_hidden,
        num_experts=args.layer_experts,
        moe_topk=args.layer_topk,
        moe_ffn_hidden_size=args.layer_ffn,
    )
    cuda = args.device == "cuda"
    config = transformer_config(arch, bf16=cuda)
    experts = GroupedExperts(args.layer_experts, config, pg_collection=get_default_pg_collection())
    dev, dtype = experts.weight1.device, experts.weight1.dtype
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    chosen = torch.rand(args.layer_tokens, args.layer_experts, generator=gen)
    chosen = chosen.topk(args.layer_topk, dim=-1).indices.flatten()
    counts = torch.bincount(chosen, minlength=args.layer_experts)  # rows per expert
    rows = int(counts.sum())
    x = torch.randn(rows, args.layer_hidden, device=dev, dtype=dtype, requires_grad=True)
    probs = torch.rand(rows, device=dev, dtype=torch.float32)
    grad = torch.randn(rows, args.layer_hidden, device=dev, dtype=dtype)
    ends = counts.to(dev).cumsum(0).to(torch.int32)
    flops = 18 * rows * args.layer_hidden * args.layer_ffn  # 3 GEMMs forward, x3 with backward

    def module() -> None:
        x.grad = experts.weight1.grad = experts.weight2.grad = None  # written, not accumulated
        out, _ = experts(x, counts, probs)
        out.backward(grad)

    w1, w2 = experts.weight1.detach(), experts.weight2.detach()
    h1 = torch.randn(rows, 2 * args.layer_ffn, device=dev, dtype=dtype)
    h2 = torch.randn(rows, args.layer_ffn, device=dev, dtype=dtype)
    xd = x.detach()

    def bare() -> None:  # the same six products: fc1, fc2 forward; dx and dW of each
        torch._grouped_mm(xd, w1.transpose(1, 2), offs=ends)
        torch._grouped_mm(h2, w2.transpose(1, 2), offs=ends)
        torch._grouped_mm(grad, w2, offs=ends)
        torch._grouped_mm(grad.t(), h2, offs=ends)
        torch._grouped_mm(h1, w1, offs=ends)
        torch._grouped_mm(h1.t(), xd, offs=ends)

    print(
        f"layer: hidden {args.layer_hidden}, expert width {args.layer_ffn}, "
        f"{args.layer_experts} experts, top-{args.layer_topk}, {args.layer_tokens} tokens "
        f"({rows} routed rows), {dtype}, {dev}",
        flush=True,
    )
    seconds = {name: time_call(fn, cuda) for name, fn in (("module", module), ("bare", bare))}
    for name, sec in seconds.items():
        print(f"{name}: {sec * 1e3:.2f} ms fwd+bwd, {flops / sec / 1e12:.1f} TFLOP/s", flush=True)
    print(f"module_vs_bare_grouped_mm: {seconds['bare'] / seconds['module']:.2f}")
    return 0


def loss_curve(args: argparse.Namespace) -> int:
    """SequentialMLP vs grouped experts, same weights, same micro-batches, `--curve` steps."""
    import torch

    from services.trainer import batching
    from services.trainer.config import TrainerConfig
    from services.trainer.grouped_experts import expert_views
    from services.trainer.policy import Policy

    arch, samples = make_arch(args, moe=True), make_samples(args)
    policies = []
    for grouped in (False, True):
        cfg = TrainerConfig(
            model="(random)",
            bf16=args.bf16,
            lr=args.lr,
            max_tokens_per_gpu=args.max_tokens_per_gpu,
            moe_grouped_experts=grouped,
        )
        policies.append(Policy(cfg, "", arch=arch))
    with torch.no_grad():  # the grouped model takes the sequential one's initial weights
        source = dict(expert_views(policies[0].model))
        for name, tensor in expert_views(policies[1].model):
            tensor.copy_(source[name])
    policies[1].optimizer.reload_model_params()  # (bf16: the fp32 master copies too)
    mbs = batching.make_micro_batches(samples, True, args.max_tokens_per_gpu, 1)
    worst = 0.0
    for step in range(args.curve):
        row = []
        for p in policies:
            stats, _, norm = p.train_step(mbs, curve_loss, with_entropy=False)
            nll = sum(float(s["nll"]) for s in stats) / sum(float(s["tokens"]) for s in stats)
            row.append((nll, norm))
        rel = abs(row[0][0] - row[1][0]) / abs(row[0][0])
        worst = max(worst, rel)
        print(
            f"step {step}: loss (mean NLL) sequential {row[0][0]:.5f} grouped {row[1][0]:.5f} "
            f"(rel diff {rel:.1e}); grad norm sequential {row[0][1]:.4f} grouped {row[1][1]:.4f}",
            flush=True,
        )
    print(f"curve_max_rel_loss_diff: {worst:.2e}")
    return 0


def curve_loss(mb, logp, _entropy):  # type: ignore[no-untyped-def]
    """Advantage-weighted log-likelihood (summed; megatron divides by the tokens); its NLL."""
    mask, adv = mb.loss_mask.to(logp.device), mb.advantages.to(logp.device)
    nll = -(logp * mask).sum()
    return -(logp * adv * mask).sum(), mask.sum().int(), {"nll": nll.detach(), "tokens": mask.sum()}


def time_call(fn, cuda: bool, repeats: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of `fn()` after 3 warm-up calls."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def make_arch(args: argparse.Namespace, moe: bool):  # type: ignore[no-untyped-def]
    """The benchmark's model; `moe=False` with experts given = the dense twin of equal
    active size (FFN width topk x expert width)."""
    from services.trainer.hf_convert import HfArch

    ffn = args.ffn_hidden_size
    if args.num_experts and not moe:
        ffn = args.moe_topk * args.moe_ffn_hidden_size
    return HfArch(
        model_type="qwen3_moe" if moe else "llama",
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=ffn,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim or args.hidden_size // args.num_heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=args.prompt_len + args.max_response_len + 1,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=moe,
        num_experts=args.num_experts if moe else 0,
        moe_topk=args.moe_topk if moe else 0,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size if moe else 0,
    )


def parameter_counts(model, arch) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(all parameters, those one token runs through: each expert counts topk / experts)."""
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name:  # SequentialMLP's local_experts, or the grouped weights
            expert += p.numel()
    share = arch.moe_topk / arch.num_experts if arch.num_experts else 1.0
    return total, int(total - expert + expert * share)


def bench_model(args, label, policy, cfg, samples, active, peak, sync) -> dict:  # type: ignore[no-untyped-def]
    """Packed vs padded logprob check, then the timed modes of one model; their results."""
    from services.trainer import batching

    check = samples[:16]  # one micro-batch each way, so both hold the same samples in order
    budget = sum(s.input_len for s in check)
    lp = [
        policy.logprobs(batching.make_micro_batches(check, packed, budget, 16))
        for packed in (True, False)
    ]
    masks = [
        batching.make_micro_batches(check, p, budget, 16)[0].loss_mask > 0 for p in (True, False)
    ]
    diff = (lp[0][0]["logp"].cpu()[masks[0]] - lp[1][0]["logp"].cpu()[masks[1]]).abs().max().item()
    print(f"[{label}] packed_vs_padded_max_logprob_diff: {diff:.2e}", flush=True)
    results = {}
    for name in args.modes:
        packed = name == "packed"
        r = run_mode(policy, cfg, samples, packed, args.iters, sync)
        results[name] = r
        print(
            f"[{label}] {name}: {r['tokens_per_s']:.0f} tokens/s, step {r['step_s']:.3f}s, "
            f"{r['micro_batches']} micro-batches, token efficiency {r['efficiency']:.2f}",
            flush=True,
        )
        # 6 * N_active * tokens rule of thumb (forward+backward), active parameters only
        tflops = 6 * active * r["tokens_per_s"] / 1e12
        r["mfu"] = tflops / peak if peak else 0.0
        print(f"[{label}] {name}_model_tflops_per_s: {tflops:.3f}", flush=True)
        if peak:
            print(f"[{label}] {name}_mfu: {tflops / peak:.3f} (of {peak:.0f} TFLOP/s matmul peak)")
    if args.profile and label != "moe_sequential":  # (its step is the slow known one)
        profile(policy, cfg, samples, args.profile, sync)
        host_syncs(policy, cfg, samples, sync)
    if len(results) < 2:
        name = args.modes[0]
        print(f"[{label}] {name}_tokens_per_s: {results[name]['tokens_per_s']:.0f}")
        return results
    ratio = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    print(f"[{label}] packed_vs_padded_tokens_per_s: {ratio:.2f}", flush=True)
    return results


def matmul_peak_tflops(n: int = 8192, repeats: int = 10) -> float:
    """The physical limit the MFU is measured against: a large bf16 matrix product."""
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def profile(policy, cfg, samples, top: int, sync) -> None:  # type: ignore[no-untyped-def]
    """One packed step under torch.profiler: the costliest kernels, and time by kind."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        one_step(policy, cfg, samples, True)
        sync()
    events = prof.key_averages()
    attr = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    on_device = torch.cuda.is_available()  # kernels only: a compiled op's CPU row repeats its time
    rows = sorted(
        (
            e
            for e in events
            if getattr(e, attr, 0) > 0 and (not on_device or str(e.device_type).endswith("CUDA"))
        ),
        key=lambda e: -getattr(e, attr),
    )
    total = sum(getattr(e, attr) for e in rows if not e.key.startswith(("aten::", "cuda")))
    kinds: dict[str, float] = {}
    for e in rows:
        if e.key.startswith(("aten::", "cuda")):  # operator rows repeat their kernels' time
            continue
        kind = kernel_kind(e.key.lower())
        kinds[kind] = kinds.get(kind, 0.0) + getattr(e, attr)
    wall = max((e.time_range.end for e in prof.events()), default=0) - min(
        (e.time_range.start for e in prof.events()), default=0
    )
    print(f"profile: {total / 1e3:.1f} ms of kernels in one packed step of {wall / 1e3:.1f} ms")
    for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<20} {us / 1e3:9.1f} ms {100 * us / max(total, 1):5.1f}%")
    for e in [e for e in rows if not e.key.startswith(("aten::", "cuda"))][:top]:
        print(f"  {getattr(e, attr) / 1e3:9.2f} ms x{e.count:<5d} {e.key[:110]}")


def host_syncs(policy, cfg, samples, sync) -> None:  # type: ignore[no-untyped-def]
    """One packed step under CUDA's sync debug mode: where the host waits for the device (each
    wait lets the GPU run dry while the host catches up), counted by the calling line."""
    import traceback
    import warnings

    import torch

    if not torch.cuda.is_available():
        return
    sites: dict[str, int] = {}

    def seen(message, *_args, **_kwargs) -> None:  # type: ignore[no-untyped-def]
        if "synchroniz" not in str(message):  # (megatron's deprecation warnings, say)
            return
        ours = ("/services/", "/megatron/", "/bench/")  # not torch's or the warnings module's
        frames = [f for f in traceback.extract_stack() if any(p in f.filename for p in ours)]
        site = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[::-1][:3])
        sites[site] = sites.get(site, 0) + 1

    sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            one_step(policy, cfg, samples, True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync()
    print(f"host syncs in one packed step: {sum(sites.values())}")
    for site, n in sorted(sites.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  x{n:<5d} {site}")


KINDS = (  # (kind, words of its kernels' names): the first that matches names a kernel's kind
    ("grouped GEMM", ("grouped", "group_", "groupproblem")),
    ("matmul", ("gemm", "sm90", "cutlass", "nvjet")),
    ("attention", ("flash", "fmha")),
    ("nccl", ("nccl",)),
    ("permute/unpermute", ("index", "scatter", "gather", "sort", "nonzero", "masked", "cumsum")),
    ("router top-k/softmax", ("topk", "softmax", "bitonic", "radix")),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, words in KINDS if any(w in name for w in words)), "other")


if __name__ == "__main__":
    sys.exit(main())
