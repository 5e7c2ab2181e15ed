"""Trainer/engine log-prob mismatch of an MoE model, with routing replay off and on.

A random-init Qwen3-MoE (written with transformers, the toy tokenizer's 16-token vocabulary)
is served by the reference engine in this process, which samples responses and reports each
token's log-prob and the experts every layer chose (`return_routed_experts`). The trainer's
megatron policy (grouped-GEMM experts) then computes the same tokens' log-probs: with its own
routing, and with routing replay (the engine's expert ids; the routing weights are still the
trainer's router's, over those experts). The dense Qwen3 of the same attention and active FFN
width gives the floor: the mismatch of the same numerics with no routing at all. If replay's
mismatch is at that floor, replaying the routing weights too would gain nothing more.

    python bench/moe_logprob_mismatch.py --device cuda     # bf16 engine and trainer
    python bench/moe_logprob_mismatch.py                   # CPU, fp32, a smaller model

Last line: `replay_on_mean_abs_logprob_diff: VALUE`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--hidden-size", type=int, default=0, help="0: 512 on CUDA, 64 on CPU")
    p.add_argument("--num-layers", type=int, default=0, help="0: 8 on CUDA, 2 on CPU")
    p.add_argument("--num-experts", type=int, default=32)
    p.add_argument("--moe-topk", type=int, default=8)
    p.add_argument("--router-std", type=float, default=0.05, help="router weights' std")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    return p.parse_args(argv)


def write_models(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    """The MoE and its dense twin (FFN width = top-k x expert width), random weights."""
    from tests.tiny_models import write_tiny

    cuda = args.device == "cuda"
    hidden = args.hidden_size or (512 if cuda else 64)
    expert = hidden // 2
    shape = dict(
        hidden_size=hidden,
        num_hidden_layers=args.num_layers or (8 if cuda else 2),
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        max_position_embeddings=512,
        intermediate_size=args.moe_topk * expert,
    )
    moe = dict(num_experts=args.num_experts, num_experts_per_tok=args.moe_topk)
    return {
        "moe": write_tiny(
            root / "moe",
            "qwen3_moe",
            router_std=args.router_std,
            **shape,
            **moe,
            moe_intermediate_size=expert,
        ),
        "dense": write_tiny(root / "dense", "qwen3_untied", **shape),
    }


def engine_samples(args: argparse.Namespace, model_dir: Path) -> list:  # type: ignore[type-arg]
    """Samples the reference engine generated, with its log-probs and routing."""
    import random

    from proto import Sample
    from proto.models import pack_routed_experts
    from services.engine.config import EngineConfig
    from services.engine.engine import Engine

    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 16) for _ in range(8)] for _ in range(args.prompts)]
    n = args.samples_per_prompt
    engine = Engine(EngineConfig(model=str(model_dir), device=args.device, prompt_cache_tokens=0))
    engine.start()
    body = {
        "input_ids": prompts,
        "return_logprob": True,
        "return_routed_experts": "moe" in model_dir.name,
        "sampling_params": {
            "max_new_tokens": args.max_new_tokens,
            "n": n,
            "ignore_eos": True,
            "sampling_seed": 1,
        },
    }
    try:
        outs = asyncio.run(engine.generate(engine.parse(body)))
    finally:
        engine.stop()
    return [
        Sample(
            prompt_ids=prompts[i // n],
            response_ids=out["output_ids"],
            response_logprobs=[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
            loss_mask=[1] * len(out["output_ids"]),
            reward=0.0,
            weight_version=0,
            routed_experts=pack_routed_experts(out["meta_info"].get("routed_experts") or ""),
        )
        for i, out in enumerate(outs)
    ]


def mismatch(args: argparse.Namespace, model_dir: Path, samples: list, replay: bool) -> tuple:  # type: ignore[type-arg]
    """(mean, max) |trainer - engine| log-prob over the response tokens."""
    import torch

    from proto import SampleGroup
    from services.trainer import batching, routing_replay
    from services.trainer.config import TrainerConfig
    from services.trainer.policy import Policy

    cfg = TrainerConfig(model=str(model_dir), bf16=args.device == "cuda", use_routing_replay=replay)
    policy = Policy(cfg, str(model_dir), train=False)
    group = SampleGroup(
        group_id="g", prompt="", label="", samples=samples, weight_version=0, created_at=0.0
    )
    train = batching.flatten([group], batching.compute_advantages([group], "grpo", True, 1e-6))
    mbs = batching.make_micro_batches(train, True, 8192, 1)
    if policy.replays:
        assert routing_replay.attach(mbs, train, policy.arch) == 0, "samples without routing"
    diffs = []
    for mb, out in zip(mbs, policy.logprobs(mbs), strict=True):
        mask = mb.loss_mask > 0
        diffs.append((out["logp"].float().cpu()[mask] - mb.behaviour_logp[mask]).abs())
    every = torch.cat(diffs)
    del policy
    return every.mean().item(), every.max().item(), every.numel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from services.trainer.policy import init_distributed

    init_distributed(tp_size=1, seed=0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_models(args, Path(tmp))
        for name, model_dir in dirs.items():
            samples = engine_samples(args, model_dir)
            for replay in (False, True) if name == "moe" else (False,):
                mean, worst, count = mismatch(args, model_dir, samples, replay)
                label = f"{name}, replay {'on' if replay else 'off'}" if name == "moe" else name
                results[label] = mean
                print(
                    f"{label}: mean |trainer - engine| log-prob {mean:.2e}, max {worst:.2e} "
                    f"({count} response tokens)",
                    flush=True,
                )
    print(f"replay_off_mean_abs_logprob_diff: {results['moe, replay off']:.2e}")
    print(f"dense_mean_abs_logprob_diff: {results['dense']:.2e}")
    print(f"replay_on_mean_abs_logprob_diff: {results['moe, replay on']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
