"""A whole `tandem up` run (two engines, the toy task) with one of its engines stopped (SIGSTOP:
a hung GPU or host) for `--stop-s` once the trainer is at step 30: the trainer's steps while it
is stopped and the longest gap between two steps. Run it from the tree to measure (its
`tandem.cli` is the one started):

    .venv/bin/python bench/up_stopped_engine.py --stop-s 30 --run-dir /tmp/stopped/run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def trainer_times(run_dir: Path) -> dict[int, float]:
    """Step -> when the trainer's record of it was written (metrics.jsonl)."""
    path, times = run_dir / "metrics.jsonl", {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:  # (a line being written)
            continue
        if row.get("source") == "trainer":
            times.setdefault(row["step"], row["time"])
    return times


def engine_of(up: subprocess.Popen, run_dir: Path) -> int:
    """The pid of the run's second engine (a child of this `tandem up`)."""
    table = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True)
    for line in table.stdout.splitlines()[1:]:
        pid, ppid, args = line.split(maxsplit=2)
        if int(ppid) == up.pid and f"{run_dir}/logs/engine1.ready.json" in args:
            return int(pid)
    raise RuntimeError("the run's second engine was not found")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stop-s", type=float, default=30.0)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=120)
    args = parser.parse_args()
    run_dir = args.run_dir.absolute()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    flags = ["--max-steps", str(args.max_steps), "--stop-accuracy", "0", "--seed", "3"]
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags]
    with open(run_dir.parent / "up.log", "w") as log:
        up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while max(trainer_times(run_dir), default=0) < 30:
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended or stalled before step 30: see {log.name}")
            time.sleep(0.2)
        engine = engine_of(up, run_dir)
        stopped_at = time.time()
        os.kill(engine, signal.SIGSTOP)
        try:
            time.sleep(args.stop_s)
        finally:
            os.kill(engine, signal.SIGCONT)
        up.wait(timeout=900)
    times = trainer_times(run_dir)
    steps = sorted(times)
    gaps = {s: times[s] - times[p] for p, s in itertools.pairwise(steps)}
    during = [s for s in steps if stopped_at <= times[s] <= stopped_at + args.stop_s]
    before = sorted(g for s, g in gaps.items() if times[s] < stopped_at)
    worst = max(gaps, key=gaps.__getitem__)
    print(
        f"exit {up.returncode}; {len(steps)} steps; median step before the stop "
        f"{before[len(before) // 2]:.2f} s; {len(during)} steps during the {args.stop_s:g} s stop; "
        f"longest gap {gaps[worst]:.2f} s (before step {worst})"
    )


if __name__ == "__main__":
    main()
