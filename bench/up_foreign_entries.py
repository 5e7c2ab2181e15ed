"""A whole `tandem up` run (toy task) into whose samples stream `--entries` foreign entries are
written once the trainer is at step 10 (copies of an entry the router wrote, XADDed by hand:
outside the router's path, as a tool or another program might); prints the groups dropped
stale before and after, per trainer step, and the run's drops. Run it from the tree to measure
(its `tandem.cli` is the one started):

    .venv/bin/python bench/up_foreign_entries.py --run-dir /tmp/foreign/run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import redis


def trainer_step(run_dir: Path) -> int:
    """The newest trainer step in the run's metrics.jsonl (0 before the first)."""
    path, step = run_dir / "metrics.jsonl", 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:  # (a line being written)
            continue
        step = max(step, row["step"]) if row.get("source") == "trainer" else step
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--entries", type=int, default=11)
    parser.add_argument("--max-steps", type=int, default=60)
    args = parser.parse_args()
    run_dir, steps = args.run_dir, args.max_steps
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir)]
    cmd += ["--max-steps", str(steps), "--stop-accuracy", "0"]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while trainer_step(run_dir) < 10:
        if up.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the run did not reach step 10:\n{up.communicate()[0][-3000:]}")
        time.sleep(0.05)
    where = json.loads((run_dir / "redis.json").read_text())
    client = redis.Redis.from_url(where["url"])
    samples, drops = (f"tandem:{where['run_id']}:{k}" for k in ("samples", "drops"))
    while not (newest := client.xrevrange(samples, count=1)):  # (acked and gone: the next)
        time.sleep(0.001)
    stale_before, at = int(client.hget(drops, "stale:groups") or 0), trainer_step(run_dir)
    for _ in range(args.entries):
        client.xadd(samples, {"d": newest[0][1][b"d"]})
    up.communicate()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    stale = ledger["dropped_groups"].get("stale", 0) - stale_before
    print(
        f"exit {up.returncode}; {args.entries} foreign entries at step {at}; groups dropped "
        f"stale before: {stale_before}, after: {stale} in {steps - at} steps "
        f"({stale / (steps - at):.2f} a step); ledger balanced {ledger['balanced']}, "
        f"drops {ledger['dropped_groups']}"
    )


if __name__ == "__main__":
    main()
