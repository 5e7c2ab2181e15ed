"""Async speed-up: the same task, model and seed trained by `tandem up` in sync mode and async.

    python bench/async_speedup.py                        # sync (0), async (1, 2), toy task
    python bench/async_speedup.py --staleness 0 1 --stop-accuracy 0.8 --up-args "--lr 2e-3"
    python bench/async_speedup.py --analyze DIR_S0 DIR_S1   # figures of finished runs only

Each `--max-staleness` value is one `tandem up` run (one after another, never at once) with the
same seed, task (the embedded toy task unless `--up-args` names data), model and batch sizes,
stopping at `--stop-accuracy`. Max staleness 0 is sync training: the rollout of batch k+1
waits for the weights of step k. Per run:

- time to target: seconds from the run's first metrics record (the router's start-up
  evaluation, published once the engines and the router are up; the trainer starts after it,
  so its start-up counts in every run alike) to the first held-out evaluation at or above the
  target; final accuracy: the last evaluation.
- seconds per step: between the first and last trainer records, over the steps between;
  1st step s: when the trainer started its first step (its start-up), from the same origin.
- trainer idle fraction: 1 - (sum of `train/step_time_s`: update + weight publish) / (time from
  the start of the first step to the end of the last). The rest is waiting for samples.
- rollout idle fraction: the share of samples of the router's `GET /rollout/status`, polled
  every `--poll-s` by this script over the same window, with no group in flight
  (`groups_in_flight` 0: the demand gate or the buffer held the loop). Neither idle fraction
  is recorded by the services themselves; these are how this script derives them.
- speed-up: sync time to target / this run's; and sync seconds per step / this run's.
- bound: from the sync run, gen = seconds per step - train (train = mean step time); sync
  costs gen + train per step, async at best max(gen, train), so the bound on the per-step
  speed-up is (gen + train) / max(gen, train).

On a machine with few cores the engines and the trainer compete for them: overlapping
the phases then makes each slower, and the measured speed-up stays below the bound.

Writes `accuracy_vs_time.png` (matplotlib) and `speedup.json` into `--out`. The last line is
`speedup_vs_sync: X`, the time-to-target speed-up of the first async run (`--max-staleness 1`
by default, `tandem up`'s default); when a run did not reach the target, the per-step speed-up,
and the line before says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROUTER_LINE = re.compile(r"router at (http://\S+)")


def up_command(run_dir: Path, staleness: int, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tandem.cli",
        "up",
        "--run-dir",
        str(run_dir),
        "--seed",
        str(args.seed),
        "--max-staleness",
        str(staleness),
        "--stop-accuracy",
        str(args.stop_accuracy),
        "--max-steps",
        str(args.max_steps),
        "--time-limit-s",
        str(args.time_limit_s),
        *shlex.split(args.up_args),
    ]


class StatusPoller(threading.Thread):
    """Samples the router's `GET /rollout/status` into `RUN_DIR/rollout_status.jsonl`."""

    def __init__(self, url: str, out: Path, period_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.period_s = url + "/rollout/status", period_s
        self.out = open(out, "w")  # noqa: SIM115 - closed at the end of run()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    status = json.loads(resp.read())
            except (OSError, ValueError):  # the router is stopping, or busy: a missed sample
                continue
            row = {"time": time.time(), "state": status.get("state")}
            row["groups_in_flight"] = status.get("groups_in_flight", 0)
            self.out.write(json.dumps(row) + "\n")
        self.out.close()


def run_up(run_dir: Path, staleness: int, args: argparse.Namespace) -> int:
    """One `tandem up` run; its console goes to RUN_DIR.log (and the router's state is polled)."""
    cmd = up_command(run_dir, staleness, args)
    print(f"== max staleness {staleness}: {shlex.join(cmd)}", flush=True)
    log_path = run_dir.with_name(run_dir.name + ".log")
    poller = None
    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    with (
        open(log_path, "w") as log,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[up]"):
                print("   " + line.rstrip(), flush=True)
            match = ROUTER_LINE.search(line)
            if match and poller is None:
                poller = StatusPoller(match.group(1), run_dir / "rollout_status.jsonl", args.poll_s)
                poller.start()
        code = proc.wait()
    if poller is not None:
        poller.done.set()
        poller.join(timeout=10)
    print(f"   exit code {code} after {time.monotonic() - started:.0f} s (log: {log_path})")
    # Other work on the machine slows a run: the load average says how busy it was.
    print(f"   load average (1 min) at start {load_at_start:.1f}, at end {os.getloadavg()[0]:.1f}")
    return code


# --- analysis -------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a null value (a NaN when written) is read as NaN."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: math.nan if v is None else v for k, v in row.items()} for row in rows]


def mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def analyze(run_dir: Path, target: float) -> dict:
    """The figures of one finished run folder (see the module docstring); NaN where the run
    recorded too little (it says so)."""
    path = run_dir / "metrics.jsonl"
    rows = sorted(read_rows(path), key=lambda r: r["time"]) if path.exists() else []
    if not rows:
        print(f"{path}: missing or empty, the run recorded nothing (see its log)")
    t0 = rows[0]["time"] if rows else 0.0
    evals = [(r["time"] - t0, r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    trainer = [r for r in rows if r.get("source") == "trainer" and "train/step_time_s" in r]
    reached = next((t for t, acc in evals if acc >= target), math.nan)
    out = {
        "run_dir": str(run_dir),
        "evals": evals,
        "time_to_target_s": reached,
        "final_accuracy": evals[-1][1] if evals else math.nan,
        "steps": len(trainer),
        "seconds_per_step": math.nan,
        "train_s_per_step": mean([r["train/step_time_s"] for r in trainer[1:] or trainer]),
        "first_step_s": math.nan,
        "trainer_idle": math.nan,
        "rollout_idle": math.nan,
    }
    if len(trainer) < 2:
        return out
    first, last = trainer[0], trainer[-1]
    out["seconds_per_step"] = (last["time"] - first["time"]) / (len(trainer) - 1)
    start = first["time"] - first["train/step_time_s"]
    window = last["time"] - start
    out["first_step_s"] = start - t0  # the trainer's start-up (and first batch) is in every run
    out["trainer_idle"] = 1 - sum(r["train/step_time_s"] for r in trainer) / window
    status_path = run_dir / "rollout_status.jsonl"
    if status_path.exists():
        polled = [r for r in read_rows(status_path) if start <= r["time"] <= last["time"]]
        if polled:
            out["rollout_idle"] = sum(r["groups_in_flight"] == 0 for r in polled) / len(polled)
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) and not math.isnan(b) else math.nan


def plot(results: dict[int, dict], target: float, path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (speedup.json has the figures)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for staleness, r in results.items():
        if r["evals"]:
            label = (
                "sync (max staleness 0)" if staleness == 0 else f"async, max staleness {staleness}"
            )
            ax.plot(*zip(*r["evals"], strict=True), marker=".", label=label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds since the run's first metrics record")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title("Tandem: sync vs async, same task, model and seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(results: dict[int, dict], target: float, out: Path) -> float:
    """Prints the table and the bound; returns the headline speed-up."""
    sync = results.get(0)
    if sync is None:
        raise SystemExit("no sync run (max staleness 0) to compare with: add 0 to --staleness")
    gen = sync["seconds_per_step"] - sync["train_s_per_step"]
    train = sync["train_s_per_step"]
    bound = ratio(gen + train, max(gen, train))
    print(
        f"\n{'max staleness':>13} {'to target s':>11} {'final acc':>9} {'steps':>5} "
        f"{'s/step':>7} {'1st step s':>10} {'trainer idle':>12} {'rollout idle':>12} {'speed-up':>8} "
        f"{'per step':>8}"
    )
    for staleness, r in results.items():
        r["speedup"] = ratio(sync["time_to_target_s"], r["time_to_target_s"])
        r["speedup_per_step"] = ratio(sync["seconds_per_step"], r["seconds_per_step"])
        print(
            f"{staleness:>13} {r['time_to_target_s']:>11.1f} {r['final_accuracy']:>9.2f} "
            f"{r['steps']:>5} {r['seconds_per_step']:>7.2f} {r['first_step_s']:>10.1f} "
            f"{r['trainer_idle']:>12.1%} "
            f"{r['rollout_idle']:>12.1%} {r['speedup']:>8.2f} {r['speedup_per_step']:>8.2f}"
        )
    print(
        f"\nphases of the sync run, per step: generation {gen:.2f} s, training {train:.2f} s; "
        f"sync = gen + train = {gen + train:.2f} s, async bound = max(gen, train) = "
        f"{max(gen, train):.2f} s: per-step speed-up bound {bound:.2f}"
    )
    print(
        f"(this machine has {os.cpu_count()} CPU cores; with few, the engines and the trainer "
        "compete for them, so overlapping the phases slows each and the speed-up stays below "
        "the bound)"
    )
    plotted = plot(results, target, out / "accuracy_vs_time.png")
    if plotted:
        print(f"accuracy vs time: {plotted}")
    summary = {str(k): {**v, "evals": v["evals"]} for k, v in results.items()}
    summary["bound"] = {"gen_s": gen, "train_s": train, "speedup_bound": bound}
    (out / "speedup.json").write_text(json.dumps(summary, indent=1) + "\n")
    first_async = next((r for k, r in results.items() if k > 0), None)
    if first_async is None:
        return math.nan
    if math.isnan(first_async["speedup"]):
        print("a run did not reach the target: the speed-up below is per step, not to target")
        return first_async["speedup_per_step"]
    return first_async["speedup"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-accuracy", type=float, default=0.9)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--time-limit-s", type=float, default=600.0, help="per run")
    parser.add_argument("--up-args", default="", help="more `tandem up` flags, one string")
    parser.add_argument("--poll-s", type=float, default=0.2, help="router status sampling")
    parser.add_argument("--out", type=Path, default=None, help="default runs/async-speedup-TIME")
    parser.add_argument(
        "--analyze",
        type=Path,
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="only report finished run folders, one per --staleness value, in that order",
    )
    args = parser.parse_args(argv)
    if sorted(set(args.staleness)) != sorted(args.staleness) or min(args.staleness) < 0:
        parser.error("--staleness: distinct values >= 0, e.g. 0 1 2")
    out = args.out or Path("runs") / time.strftime("async-speedup-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    if args.analyze is not None:
        if len(args.analyze) != len(args.staleness):
            parser.error(f"--analyze: give {len(args.staleness)} run folders (--staleness order)")
        dirs = dict(zip(args.staleness, args.analyze, strict=True))
    else:
        dirs = {s: out / f"staleness{s}" for s in args.staleness}
        for staleness, run_dir in dirs.items():
            run_up(run_dir, staleness, args)
    results = {s: analyze(d, args.stop_accuracy) for s, d in sorted(dirs.items())}
    speedup = report(results, args.stop_accuracy, out)
    print(f"speedup_vs_sync: {speedup:.2f}")
    return 1 if any(r["steps"] < 2 for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
