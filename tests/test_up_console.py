"""`tandem up`'s console line: what it shows before the first evaluation and rollout figures."""

from __future__ import annotations

from pathlib import Path

from proto import MetricsRecord
from tandem.progress import RunProgress


def test_the_console_line_shows_a_dash_until_accuracy_and_throughput_are_reported(
    tmp_path: Path,
) -> None:
    progress = RunProgress(tmp_path)
    first = progress.add(MetricsRecord(source="trainer", step=1, values={}, time=0.0))
    assert first is not None
    assert "held-out acc - |      - samples/s |" in first
    router = {"eval/accuracy": 0.25, "rollout/samples_per_s": 1234.0}
    assert progress.add(MetricsRecord(source="router", step=1, values=router, time=0.0)) is None
    second = progress.add(MetricsRecord(source="trainer", step=2, values={}, time=0.0))
    assert second is not None and "held-out acc 0.25 (v1) |   1234 samples/s" in second
    progress.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
