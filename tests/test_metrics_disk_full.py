"""A `tandem up` run stopped by a full disk and resumed: metrics.jsonl ends with every metrics
record the run's stream holds, each once. The record whose write failed (and those after it)
are written on the resume: it reads on after the newest record metrics.jsonl holds, not after
the stream's end (which lost that record: a step missing from metrics.jsonl, summary.json a
step short). The full disk is /dev/full under metrics.jsonl (every write: ENOSPC); real
services, real Valkey (the run's own, read again on its append-only files afterwards)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from tandem.progress import metrics_rows
from tandem.run_redis import run_id_of

UP = [sys.executable, "-m", "tandem.cli", "up"]


@pytest.mark.slow
def test_metrics_of_a_run_stopped_by_a_full_disk_are_all_in_metrics_jsonl_after_its_resume(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").symlink_to("/dev/full")
    flags = ["--max-steps", "4", "--stop-accuracy", "0"]
    full = subprocess.run(
        [*UP, "--run-dir", str(run_dir), *flags], capture_output=True, text=True, timeout=600
    )
    said = full.stdout + full.stderr
    assert full.returncode == 1 and "No space left on device" in said, said
    (run_dir / "metrics.jsonl").unlink()  # room again
    (run_dir / "metrics.jsonl").touch()
    resumed = subprocess.run(
        [*UP, "--resume", str(run_dir)], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    rows = [(r["source"], r["step"], r["time"]) for r in metrics_rows(run_dir)]
    with RedisServer(log_dir=tmp_path / "log", data_dir=run_dir / "redis") as server:
        buffer = SampleBuffer(BufferConfig(server.url, run_id_of(run_dir)))
        stream = [(r.source, r.step, r.time) for _id, r in buffer.read_metrics("0")]
    assert stream and sorted(rows) == sorted(stream)  # each record once, none missing
    steps = [step for source, step, _ in rows if source == "trainer"]
    assert steps == [1, 2, 3, 4]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4, summary
