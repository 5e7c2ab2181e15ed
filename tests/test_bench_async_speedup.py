"""The async speed-up bench's report (`--analyze`) on two run folders laid out as `tandem up`
writes them: a sync run and an async one whose timings are known, so every figure it derives
(time to target, seconds per step, idle fractions, speed-ups, the bound) can be checked. The
runs themselves take minutes: the bench is run by hand (bench/async_speedup.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_run(run_dir: Path, period_s: float, reach_s: float, in_flight: list[int]) -> None:
    """Trainer steps every `period_s` (0.4 s of it training), evaluations rising to 0.95 at
    `reach_s`, and router status samples with `in_flight` groups in flight, one per 0.1 s."""
    run_dir.mkdir()
    rows = [{"source": "router", "step": 0, "time": 1000.0, "eval/accuracy": 0.0}]
    for k in range(1, 11):
        t = 1000.0 + 2.0 + k * period_s
        rows.append({"source": "trainer", "step": k, "time": t, "train/step_time_s": 0.4})
    rows.append({"source": "router", "step": 5, "time": 1000.0 + reach_s / 2, "eval/accuracy": 0.5})
    rows.append({"source": "router", "step": 9, "time": 1000.0 + reach_s, "eval/accuracy": 0.95})
    rows.append(
        {"source": "router", "step": 10, "time": 1000.0 + reach_s + 1, "eval/accuracy": 0.9}
    )
    with open(run_dir / "metrics.jsonl", "w") as f:
        for row in sorted(rows, key=lambda r: -r["time"]):  # any order: the bench sorts
            f.write(json.dumps(row) + "\n")
    start = 1000.0 + 2.0 + period_s - 0.4
    with open(run_dir / "rollout_status.jsonl", "w") as f:
        for k, n in enumerate(in_flight):
            f.write(json.dumps({"time": start + 0.1 * k, "groups_in_flight": n}) + "\n")


def test_the_speedup_report_derives_each_figure_from_the_run_folders(tmp_path):
    write_run(tmp_path / "sync", 1.0, 20.0, [0, 0, 1, 1])
    write_run(tmp_path / "async", 0.5, 10.0, [1, 1, 1, 0])
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/async_speedup.py"),
            "--staleness",
            "0",
            "1",
            "--analyze",
            str(tmp_path / "sync"),
            str(tmp_path / "async"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "speedup_vs_sync: 2.00", result.stdout  # 20 s / 10 s to 0.9
    figures = json.loads((tmp_path / "out" / "speedup.json").read_text())
    sync, fast = figures["0"], figures["1"]
    assert sync["time_to_target_s"] == 20.0 and fast["time_to_target_s"] == 10.0
    assert sync["final_accuracy"] == 0.9 and sync["steps"] == 10
    assert abs(sync["seconds_per_step"] - 1.0) < 1e-9 and abs(fast["seconds_per_step"] - 0.5) < 1e-9
    # 10 steps of 0.4 s in 9 periods + 0.4 s of window
    assert abs(sync["trainer_idle"] - (1 - 4.0 / 9.4)) < 1e-9
    assert abs(fast["trainer_idle"] - (1 - 4.0 / 4.9)) < 1e-9
    assert sync["rollout_idle"] == 0.5 and fast["rollout_idle"] == 0.25
    assert abs(fast["speedup_per_step"] - 2.0) < 1e-9
    # sync: gen 0.6 s + train 0.4 s per step; async at best max(0.6, 0.4)
    assert abs(figures["bound"]["speedup_bound"] - 1.0 / 0.6) < 1e-9
    assert "compete for" in result.stdout
    assert (tmp_path / "out" / "accuracy_vs_time.png").stat().st_size > 0
