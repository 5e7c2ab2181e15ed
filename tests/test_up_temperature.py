"""`tandem up` sampling at a temperature other than 1: the trainer scores each sample under the
distribution it was drawn from, from the start and across a temperature PATCHed mid-run.

Before, the trainer had no temperature: at 0.7 the step-0 trainer/engine log-prob max diff was
0.498 and a PATCH to 0.7 took it to 0.84, without a word. Every service is a real process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_until
from tests.test_up_process import metrics, run_up

pytestmark = pytest.mark.e2e

BOUND = 1e-3  # trainer/engine log-prob max abs diff on same-version samples, fp32


def test_a_run_sampled_at_temperature_0_7_reaches_the_goal_with_trainer_and_engines_in_agreement(
    tmp_path: Path,
) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[router]\nrollout_temperature = 0.7\n")
    run_dir = tmp_path / "run"
    result = run_up(run_dir, "--config", str(config), "--max-steps", "300")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rollout_temperature = 0.7" in (run_dir / "config.toml").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "reached_accuracy", summary  # the default goal, 0.9
    assert summary["accuracy_best"] >= 0.9
    assert summary["logprob_abs_diff_max_step0"] < BOUND
    assert summary["steps_with_same_version_samples"] >= 1
    assert summary["logprob_abs_diff_max_same_version"] < BOUND
    assert "[up] warning: the trainer's log-probs differ" not in result.stdout


def router_of(run_dir: Path) -> tuple[str, dict[str, str]]:
    ready = json.loads((run_dir / "logs" / "router.ready.json").read_text())
    token = (run_dir / "api_token").read_text().strip()
    return ready["url"], {"Authorization": f"Bearer {token}"}


def trainer_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            continue
    return [r for r in rows if r["source"] == "trainer"]


def test_a_temperature_patched_mid_run_keeps_trainer_and_engines_in_agreement_across_it(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    # Synchronous (max staleness 0): every step trains on samples of the trainer's own version,
    # so every step measures the same-version diff, before and after the change.
    flags = ["--max-steps", "24", "--stop-accuracy", "0", "--max-staleness", "0", "--seed", "5"]
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: len(trainer_steps(run_dir)) >= 6, "6 trainer steps", 300)
        url, token = router_of(run_dir)
        patched = httpx.patch(
            url + "/rollout/config", json={"rollout_temperature": 0.7}, headers=token, timeout=30
        )
        assert patched.status_code == 200, patched.text
        at = max(r["step"] for r in trainer_steps(run_dir))

        def drawn_at_0_7() -> bool:
            groups = httpx.get(url + "/rollout/samples", timeout=30).json()["groups"]
            return any(s["temperature"] == 0.7 for g in groups for s in g["samples"])

        wait_until(drawn_at_0_7, "samples drawn at 0.7 among the router's latest", 120)
        out, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 24
    assert summary["logprob_abs_diff_max_step0"] < BOUND
    assert summary["logprob_abs_diff_max_same_version"] < BOUND
    after = [
        r["train/logprob_abs_diff_max"]
        for r in metrics(run_dir)
        if r["source"] == "trainer" and r["step"] > at + 2  # trained on groups made after it
    ]
    measured = [d for d in after if not math.isnan(d)]
    assert len(measured) >= 10 and max(measured) < BOUND, after
    assert "[up] warning: the trainer's log-probs differ" not in out
