"""The buffer throughput bench runs end to end (a short run; its numbers are not checked)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_buffer_bench_runs_and_ends_with_the_ratio_line() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/buffer_throughput.py"), "--seconds", "0.5"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    names = [line.split(":")[0] for line in lines]
    names_wanted = ("raw_xadd_per_s", "event_loop", "consume_groups_per_s")
    names_wanted += ("consume_groups_per_s_at_4x_batch",)
    names_wanted += (
        "consume_groups_per_s_without_read_ahead",
        "consume_groups_per_s_one_put_at_a_time",
    )
    for name in (*names_wanted, "latency_p50_ms", "latency_p99_ms"):
        assert name in names, proc.stdout
    assert re.fullmatch(r"buffer_consume_vs_raw_xadd: \d+\.\d\d", lines[-1]), lines[-1]
