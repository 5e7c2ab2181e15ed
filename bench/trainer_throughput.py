"""Trainer throughput: packed (THD, token budget) vs right-padded micro-batches, same model, same run.

One "step" is what the trainer does per optimizer step: a forward-only recompute of log-probs,
then forward+backward with the RL loss and an AdamW step. Samples have a fixed prompt length
and long-tailed (log-normal) response lengths. Throughput counts real tokens only.

CPU (default: the toy-sized model):
    python bench/trainer_throughput.py
GPU, ~1B model (16 layers, hidden 2048), bf16:
    python bench/trainer_throughput.py --device cuda --bf16 --hidden-size 2048 --num-layers 16 \
        --num-heads 16 --num-kv-heads 8 --ffn-hidden-size 5632 --vocab-size 32000 \
        --num-samples 256 --prompt-len 128 --mean-response-len 512 --max-response-len 4096 \
        --max-tokens-per-gpu 16384 --micro-batch-size 4
Last line: `packed_vs_padded_tokens_per_s: RATIO`.
"""

from __future__ import annotations

import argparse
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
    return p.parse_args(argv)


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
        samples.append(TrainSample(tokens=tokens, prompt_len=args.prompt_len, behaviour_logp=[-2.0] * n,
                                   loss_mask=[1] * n, advantages=[rng.gauss(0, 1)] * n, weight_version=0,
                                   reward=0.0))  # fmt: skip
    return samples


def run_mode(policy, cfg, samples, packed: bool, iters: int, sync) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from services.trainer import batching, losses, step_math
    from services.trainer.stats import StepStats

    times, tokens, n_mbs, occupied = [], 0, 0, 0
    for i in range(iters + 1):
        sync()
        t0 = time.perf_counter()
        mbs = batching.make_micro_batches(
            samples, packed, cfg.max_tokens_per_gpu, cfg.micro_batch_size
        )
        for mb, out in zip(mbs, policy.logprobs(mbs), strict=True):
            mb.extra["proximal_logp"] = out["logp"]
        loss_fn = step_math.LossFunction(cfg, losses.PolicyLossConfig(), 1, StepStats())
        policy.train_step(mbs, loss_fn, with_entropy=False)
        sync()
        if i:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - t0)
        tokens = sum(mb.num_tokens for mb in mbs)
        n_mbs = len(mbs)
        occupied = (
            len(mbs) * cfg.max_tokens_per_gpu if packed else sum(mb.input_ids.numel() for mb in mbs)
        )
    median = sorted(times)[len(times) // 2]
    return {"step_s": median, "tokens_per_s": tokens / median, "micro_batches": n_mbs,
            "efficiency": tokens / occupied, "tokens": tokens}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the trainer picks CUDA whenever it sees one
    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.hf_convert import HfArch
    from services.trainer.policy import Policy, init_distributed

    torch.set_num_threads(args.threads)
    init_distributed(tp_size=1, seed=args.seed)
    arch = HfArch(
        model_type="llama", vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads, head_dim=args.hidden_size // args.num_heads, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=args.prompt_len + args.max_response_len + 1,
        tie_word_embeddings=False, qkv_bias=False,
    )  # fmt: skip
    cfg = TrainerConfig(model="(random)", bf16=args.bf16, max_tokens_per_gpu=args.max_tokens_per_gpu,
                        micro_batch_size=args.micro_batch_size)  # fmt: skip
    policy = Policy(cfg, "", arch=arch)
    params = sum(p.numel() for p in policy.model.parameters())
    samples = make_samples(args)
    lengths = sorted(len(s.tokens) - args.prompt_len for s in samples)
    print(f"device {args.device} params {params / 1e6:.1f}M samples {len(samples)} response len "
          f"p50 {lengths[len(lengths) // 2]} p90 {lengths[int(len(lengths) * 0.9)]} max {lengths[-1]}", flush=True)  # fmt: skip
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
    print(f"packed_vs_padded_max_logprob_diff: {diff:.2e}", flush=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    results = {}
    for name, packed in (("packed", True), ("padded", False)):
        r = run_mode(policy, cfg, samples, packed, args.iters, sync)
        results[name] = r
        print(f"{name}: {r['tokens_per_s']:.0f} tokens/s, step {r['step_s']:.3f}s, "
              f"{r['micro_batches']} micro-batches, token efficiency {r['efficiency']:.2f}", flush=True)  # fmt: skip
        if args.device == "cuda":  # 6·N·tokens rule of thumb (forward+backward)
            print(
                f"{name}_model_tflops_per_s: {6 * params * r['tokens_per_s'] / 1e12:.1f}",
                flush=True,
            )
    ratio = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    print(f"packed_vs_padded_tokens_per_s: {ratio:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
