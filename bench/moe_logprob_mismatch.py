"""Trainer/engine log-prob mismatch of an MoE model: routing replay off, on, and with weights.

A random-init Qwen3-MoE (written with transformers, the toy tokenizer's 16-token vocabulary)
is served by the reference engine in this process, which samples responses and reports each
token's log-prob and the experts every layer chose (`return_routed_experts`). The trainer's
megatron policy (grouped-GEMM experts) then computes the same tokens' log-probs three ways:
with its own routing; with routing replay (the engine's expert ids; the routing weights are
still the trainer's router's, over those experts); and with replay of ids and weights, where
each MoE layer's router output also takes the engine model's top-k weights (after
`norm_topk_prob`), so that only the experts' and attention's numerics differ. Those weights
come from a teacher-forced forward of the same HF model (same files, dtype and device as the
engine) over each sample's prompt + response, hooks on every layer's gate capturing its top-k
weights and ids; positions (and layers) where its ids differ from the engine's (incremental
decoding may flip near-ties) keep the trainer's weights, and their share is reported. The
dense Qwen3 of the same attention and active FFN width gives the floor: the mismatch of the
same numerics with no routing at all.

    python bench/moe_logprob_mismatch.py --device cuda     # bf16 engine and trainer
    python bench/moe_logprob_mismatch.py                   # CPU, fp32, a smaller model

Last two lines: `replay_weights_mean_abs_logprob_diff: VALUE`,
`replay_on_mean_abs_logprob_diff: VALUE`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def teacher_forced_routing(
    args: argparse.Namespace, model_dir: Path, train: list[Any]
) -> tuple[list[Any], int, int]:
    """Per sample, what the engine's HF model's gates give in one teacher-forced forward over
    its input positions `[0, prompt + response - 1)`: (top-k weights, expert ids, whether the
    ids are the engine's as a set), `[positions, layers, top_k]` (the last `[positions,
    layers]`); and how many positions differ from the engine's ids in some layer, of how many."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer import routing_replay

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model.to(args.device).eval()
    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    seen: list[tuple[Any, Any]] = []  # each gate's (weights, ids) of the current forward
    hooks = [g.register_forward_hook(lambda _m, _i, out: seen.append(out[1:])) for g in gates]
    routes, differ, total = [], 0, 0
    try:
        for s in train:
            seen.clear()
            with torch.no_grad():
                inputs = torch.as_tensor(s.tokens[None, :-1], dtype=torch.long, device=args.device)
                model(inputs, use_cache=False)
            weights = torch.stack([w for w, _ in seen], 1).float().cpu()
            ids = torch.stack([i for _, i in seen], 1).cpu()
            engine = routing_replay.decode(s.routed_experts, s.input_len, *ids.shape[1:])
            assert engine is not None, "a sample without routing"
            same = (ids.sort(-1).values == engine.sort(-1).values).all(-1)
            routes.append((weights, ids, same))
            differ += int((~same.all(-1)).sum())
            total += same.shape[0]
    finally:
        for h in hooks:
            h.remove()
    del model
    return routes, differ, total


def given_routing(mb: Any, routes: list[Any]) -> tuple[Any, Any, Any]:
    """`teacher_forced_routing`'s routes laid out as micro-batch `mb`'s input tokens (as
    `routing_replay.attach` lays out the engine's ids): ids, weights `[rows, S, layers,
    top_k]` and where they are given `[rows, S, layers]` (False at padding)."""
    import torch

    rows, width = mb.input_ids.shape
    layers, topk = routes[0][1].shape[1:]
    ids = torch.zeros(rows, width, layers, topk, dtype=torch.long)
    weights = torch.zeros(rows, width, layers, topk)
    given = torch.zeros(rows, width, layers, dtype=torch.bool)
    for k, (row, _start, stop) in enumerate(mb.response_spans):
        w, i, same = routes[mb.sample_index[k]]
        span = slice(stop - w.shape[0], stop)
        ids[row, span], weights[row, span], given[row, span] = i, w, same
    return ids, weights, given


@contextmanager
def router_weights(model: Any, ids: Any, weights: Any, given: Any) -> Any:
    """While open, each MoE layer's router returns `weights` for experts `ids` (`given_routing`)
    where given, its own probabilities elsewhere. megatron sees tokens sequence-major
    (`[S, rows]` flattened), as in `routing_replay.apply`."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    def hook(layer: int) -> Any:
        def swap(_router: Any, _inputs: Any, out: Any) -> Any:
            probs, routing_map = out

            def flat(t: Any) -> Any:
                return t[:, :, layer].transpose(0, 1).reshape(probs.shape[0], -1).to(probs.device)

            mine = torch.zeros_like(probs).scatter(1, flat(ids), flat(weights).to(probs.dtype))
            keep = flat(given)
            # where given, the replayed experts (the engine's) are the weights' experts
            assert torch.equal((mine > 0) & keep, routing_map & keep), "misplaced tokens"
            return torch.where(keep, mine, probs), routing_map

        return swap

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    handles = [r.register_forward_hook(hook(layer)) for layer, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def mismatch(
    args: argparse.Namespace,
    model_dir: Path,
    samples: list[Any],
    replay: bool,
    weights: bool = False,
) -> tuple[float, float, int, int, int]:
    """(mean, max |trainer - engine| log-prob over the response tokens, their count, and with
    `weights`: positions whose teacher-forced ids differ from the engine's, of how many)."""
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
    differ = total = 0
    if weights:
        routes, differ, total = teacher_forced_routing(args, model_dir, train)
        outs = []
        for mb in mbs:
            with router_weights(policy.model, *given_routing(mb, routes)):
                outs += policy.logprobs([mb])
    else:
        outs = policy.logprobs(mbs)
    diffs = []
    for mb, out in zip(mbs, outs, strict=True):
        mask = mb.loss_mask > 0
        diffs.append((out["logp"].float().cpu()[mask] - mb.behaviour_logp[mask]).abs())
    every = torch.cat(diffs)
    del policy
    return every.mean().item(), every.max().item(), every.numel(), differ, total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from services.trainer.policy import init_distributed

    init_distributed(tp_size=1, seed=0)
    variants = {  # label: (model, replay, weights)
        "moe, replay off": ("moe", False, False),
        "moe, replay on": ("moe", True, False),
        "moe, replay ids+weights": ("moe", True, True),
        "dense": ("dense", False, False),
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_models(args, Path(tmp))
        samples = {name: engine_samples(args, model_dir) for name, model_dir in dirs.items()}
        for label, (name, replay, weights) in variants.items():
            mean, worst, count, differ, total = mismatch(
                args, dirs[name], samples[name], replay, weights
            )
            results[label] = mean
            print(
                f"{label}: mean |trainer - engine| log-prob {mean:.2e}, max {worst:.2e} "
                f"({count} response tokens)",
                flush=True,
            )
            if weights:
                print(
                    f"teacher-forced vs engine expert ids: {differ} of {total} input positions "
                    f"differ in some layer ({differ / total:.2%}; the trainer's weights there)",
                    flush=True,
                )
    print(f"replay_off_mean_abs_logprob_diff: {results['moe, replay off']:.2e}")
    print(f"dense_mean_abs_logprob_diff: {results['dense']:.2e}")
    print(f"replay_weights_mean_abs_logprob_diff: {results['moe, replay ids+weights']:.2e}")
    print(f"replay_on_mean_abs_logprob_diff: {results['moe, replay on']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
