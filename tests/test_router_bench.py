"""The overhead benchmark runs end to end (a smoke run; its numbers are not checked here)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_router_overhead_bench_runs_and_ends_with_a_name_value_line():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/router_overhead.py"),
            "--requests",
            "200",
            "--repeats",
            "1",
            "--batches",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    for target in ("direct", "tandem", "tandem-aio", "rust"):
        assert any(line.startswith(target + " ") for line in lines), target
    name, value = lines[-1].split(": ")
    # (a number: 200 requests are a few clock ticks of CPU, which may round the ratio to 0.00)
    assert name == "tandem_cpu_per_request_vs_rust_c64" and math.isfinite(float(value))
