"""Report of one or two `tandem up` runs from their run folders (metrics.jsonl, summary.json).

    python bench/run_report.py RUN_DIR                     # one run
    python bench/run_report.py ASYNC_DIR SYNC_DIR          # + async vs sync step time

Per trainer step: update time, tokens/s, model TFLOP/s per trainer GPU (6 * params * tokens / s)
and MFU against `--peak-tflops`, publish time and its GB/s (NCCL transport: export + broadcast to
every engine, blocking; ZMQ: export + hand-off to the broker, which then syncs the engines),
the same-version trainer/engine log-prob max |diff| (the check that engines serve exactly the
trainer's weights after each sync) and the mismatch KL. Then rollout tokens/s from the router's
metrics. With two runs, the wall-clock seconds per step of each and their ratio.

The first step of a run includes warm-up (allocations, kernel selection); means skip it when a
run has more than one step. The last line is `async_vs_sync_speedup: X` with two runs, else
`trainer_tokens_per_s: X`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(trainer rows by step, router rows) of a run folder."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} not found: pass the --run-dir of a `tandem up` run")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [{k: math.nan if v is None else v for k, v in r.items()} for r in rows]  # null: NaN
    trainer = sorted((r for r in rows if "train/loss" in r), key=lambda r: r["step"])
    router = [r for r in rows if "rollout/samples_per_s" in r]
    return trainer, router


def steady(values: list[float]) -> list[float]:
    return values[1:] if len(values) > 1 else values


def mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


def seconds_per_step(trainer: list[dict]) -> float:
    """Wall-clock seconds between consecutive trainer steps (from the metric timestamps)."""
    times = [r["time"] for r in trainer if "time" in r]
    if len(times) < 2:
        return math.nan
    return (times[-1] - times[0]) / (len(times) - 1)


def report(run_dir: Path, gpus: int, peak_tflops: float) -> dict[str, float]:
    trainer, router = read_metrics(run_dir)
    if not trainer:
        raise SystemExit(f"{run_dir}: no trainer step was recorded")
    print(f"== {run_dir}")
    print(
        f"{'step':>4} {'update s':>9} {'tokens':>7} {'tok/s':>8} {'TFLOP/s/GPU':>11} {'MFU':>6} "
        f"{'publish s':>9} {'GB/s':>7} {'stale':>5} {'lp |diff|':>9} {'mism KL':>8}"
    )
    tok_s, tflops, sync_s, gbps = [], [], [], []
    for r in trainer:
        update = r.get("train/update_time_s", r.get("train/step_time_s", math.nan))
        tokens = r.get("train/tokens", 0.0)
        params = r.get("train/params", math.nan)
        publish = r.get("train/publish_time_s", math.nan)
        nbytes = r.get("train/weight_bytes", math.nan)
        rate = tokens / update if update > 0 else math.nan
        per_gpu = 6 * params * rate / 1e12 / gpus
        gb_s = nbytes / publish / 1e9 if publish > 0 else math.nan
        tok_s.append(rate)
        tflops.append(per_gpu)
        sync_s.append(publish)
        gbps.append(gb_s)
        print(
            f"{r['step']:>4} {update:>9.3f} {tokens:>7.0f} {rate:>8.0f} {per_gpu:>11.1f} "
            f"{per_gpu / peak_tflops:>6.1%} {publish:>9.3f} {gb_s:>7.1f} "
            f"{r.get('train/staleness_mean', math.nan):>5.2f} "
            f"{r.get('train/logprob_abs_diff_max', math.nan):>9.2e} "
            f"{r.get('train/mismatch_kl', math.nan):>8.1e}"
        )
    rollout = [r["rollout/samples_per_s"] * r.get("rollout/response_len_mean", 0.0) for r in router]
    figures = {
        "trainer_tokens_per_s": mean(steady(tok_s)),
        "trainer_tflops_per_gpu": mean(steady(tflops)),
        "publish_s": mean(steady(sync_s)),
        "publish_gb_per_s": mean(steady(gbps)),
        "rollout_response_tokens_per_s": mean(rollout),
        "seconds_per_step": seconds_per_step(trainer),
        "weight_gb": trainer[-1].get("train/weight_bytes", math.nan) / 1e9,
        "lp_diff_max_same_version": max(
            (
                r["train/logprob_abs_diff_max"]
                for r in trainer
                if not math.isnan(r.get("train/logprob_abs_diff_max", math.nan))
            ),
            default=math.nan,
        ),
    }
    figures["mfu"] = figures["trainer_tflops_per_gpu"] / peak_tflops
    for key, value in figures.items():
        print(f"{key:>32}: {value:.4g}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, help="one run, or an async and a sync run"
    )
    parser.add_argument(
        "--trainer-gpus",
        type=int,
        default=1,
        help="GPUs the trainer used (model TFLOP/s and MFU are per GPU)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="the GPU's dense bf16 peak for MFU (H100/H200 SXM: 989)",
    )
    args = parser.parse_args(argv)
    if len(args.run_dirs) > 2:
        parser.error("give one run folder, or two (async, then sync)")
    figures = [report(d, args.trainer_gpus, args.peak_tflops) for d in args.run_dirs]
    if len(figures) == 2:
        a, s = figures[0]["seconds_per_step"], figures[1]["seconds_per_step"]
        print(f"seconds per step: async {a:.2f}, sync {s:.2f}")
        print(f"async_vs_sync_speedup: {s / a:.2f}")
    else:
        print(f"trainer_tokens_per_s: {figures[0]['trainer_tokens_per_s']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
