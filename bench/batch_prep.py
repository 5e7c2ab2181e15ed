"""The trainer's host-side work between a rollout in hand and its first forward: advantages,
flattening, micro-batches (services/trainer/batching.py), against the least such work can cost.

A rollout of `--groups` groups of `--samples` samples (`--prompt-len` + `--response-len`
tokens), packed and decoded as the trainer reads them from the buffer. Ours: `compute_advantages`,
`flatten` and `make_micro_batches` (packed, `--max-tokens-per-gpu`) on one CPU thread. The limit:
the same per-token bytes (token ids, log-probs) made into tensors in one copy each, nothing
else. The GPU waits for this work at every rollout (it is not overlapped with training).

    python bench/batch_prep.py
Last line: `batch_prep_vs_copy: X` (our time over the copy's; lower is better).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto import Sample, SampleGroup
from proto.packed import PackedGroup, decode_entry, encode_entry, pack
from services.trainer import batching


def rollout(args: argparse.Namespace) -> list[PackedGroup]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(args.groups):
        prompt = rng.integers(0, 150_000, args.prompt_len).tolist()
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=rng.integers(0, 150_000, args.response_len).tolist(),
                response_logprobs=(-rng.random(args.response_len)).tolist(),
                loss_mask=[1] * args.response_len,
                reward=float(j % 2),
                weight_version=3,
                token_versions=[3] * args.response_len,
            )
            for j in range(args.samples)
        ]
        group = SampleGroup(
            group_id=f"p{g}",
            prompt="q",
            label="a",
            samples=samples,
            weight_version=3,
            created_at=0.0,
        )
        out += decode_entry(encode_entry([pack(group)]))  # as the intake hands them over
    return out


def ours(groups: list[PackedGroup], max_tokens: int) -> int:
    adv = batching.compute_advantages(groups, "grpo", True, 1e-6)  # type: ignore[arg-type]
    samples = batching.flatten(groups, adv)  # type: ignore[arg-type]
    return len(batching.make_micro_batches(samples, True, max_tokens, 0))


def copy_only(groups: list[PackedGroup]) -> int:
    samples = [s for g in groups for s in g.samples]
    ids = np.frombuffer(b"".join(s.prompt + s.response for s in samples), "<i4").astype(np.int64)
    logp = np.frombuffer(b"".join(s.logprobs for s in samples), "<f4").astype(np.float32)
    return int(torch.from_numpy(ids).numel() + torch.from_numpy(logp).numel())


def best_of(runs: int, fn: object, *args: object) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn(*args)  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=64, help="Groups (rollout_batch_size).")
    parser.add_argument("--samples", type=int, default=8, help="Samples a group.")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=2048)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--runs", type=int, default=3, help="Best of this many runs each.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    groups = rollout(args)
    tokens = args.groups * args.samples * (args.prompt_len + args.response_len)
    ours_s = best_of(args.runs, ours, groups, args.max_tokens_per_gpu)
    copy_s = best_of(args.runs, copy_only, groups)
    print(f"tokens: {tokens} ({args.groups} groups x {args.samples} samples)")
    print(f"ours_s: {ours_s:.3f} ({ours_s / tokens * 1e9:.0f} ns a token)")
    print(f"copy_s: {copy_s:.3f} ({copy_s / tokens * 1e9:.1f} ns a token)")
    print(f"batch_prep_vs_copy: {ours_s / copy_s:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
