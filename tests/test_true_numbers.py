"""Every number a user sees is true: metrics.jsonl and `tandem metrics --json` are strict JSON,
Prometheus names pass promtool's lint and mean one thing each, reward failures are said with
their share, the ledger's drop lines keep their units apart. Real Valkey, a real router process
against a stand-in engine where the router's records are the subject."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from proto import MetricsRecord, Sample, SampleGroup
from services.rollout_router.rollout.metrics import redis_gauges
from services.sample_buffer import AsyncSampleBuffer, SampleBuffer
from services.sample_buffer.ledger import Ledger
from services.trainer.config import TrainerConfig
from services.trainer.observe import TrainerObserver
from tandem.metrics_cli import format_record
from tandem.progress import RunProgress, metrics_rows
from tests.helpers import router_args, wait_until

ROOT = Path(__file__).resolve().parents[1]


def strict(line: str) -> dict:
    """A JSON line read as a strict parser reads it (NaN and Infinity are not JSON)."""
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON: {line}"))


def trainer_record(step: int, **values: float) -> MetricsRecord:
    base = {"train/reward_mean": 0.5, "train/samples": 8.0, "train/step_time_s": 1.0}
    return MetricsRecord(source="trainer", step=step, values={**base, **values}, time=time.time())


def test_metrics_jsonl_writes_null_for_nan_and_a_resume_reads_it_back(tmp_path) -> None:
    progress = RunProgress(tmp_path)
    progress.add(trainer_record(1, **{"train/logprob_abs_diff_max": 1e-6}))
    progress.add(trainer_record(2, **{"train/logprob_abs_diff_max": math.nan}))  # no same-version
    progress.close()
    rows = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/logprob_abs_diff_max"] for r in rows] == [1e-6, None]
    assert math.isnan(list(metrics_rows(tmp_path))[1]["train/logprob_abs_diff_max"])
    resumed = RunProgress(tmp_path, resumed=True)  # folds the null back in as "no value"
    assert (resumed.step, resumed.logprob_diff_steps, resumed.logprob_diff_max) == (2, 1, 1e-6)
    resumed.close()


def test_tandem_metrics_json_lines_are_strict_json() -> None:
    record = trainer_record(3, **{"train/loss": math.nan, "train/grad_norm": math.inf})
    row = strict(format_record(record, [], as_json=True))
    assert row["train/loss"] is None and row["train/grad_norm"] is None and row["step"] == 3


def test_metrics_png_has_one_panel_per_quantity(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    progress = RunProgress(tmp_path)
    for step in (1, 2, 3):
        progress.add(trainer_record(step, **{"train/loss": 0.1 * step, "train/tokens_per_s": 9.0}))
    path = progress.plot(tmp_path / "metrics.png")
    progress.close()
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    assert height > width, "five panels stacked (the one panel was wider than high)"


# promtool check metrics (client_golang's promlint): units spelled out, `_total` on counters only.
ABBREVIATED = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")


def promlint(text: str) -> list[str]:
    """promtool's naming problems of an exposition text (its metric-name rules)."""
    problems = []
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        for unit in ABBREVIATED:
            if f"_{unit}_" in name or name.endswith(f"_{unit}"):
                problems.append(f"{name}: metric names should not contain abbreviated units")
        if (kind == "counter") != name.endswith("_total"):
            problems.append(f"{name}: `_total` is for counters and every counter has it")
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            problems.append(f"{name}: not snake_case")
    return problems


def test_the_trainers_prometheus_names_pass_promtools_lint() -> None:
    text = TrainerObserver(TrainerConfig(model="m"), None).render()
    assert "tandem_trainer_tokens_per_second" in text
    assert promlint(text) == []


def test_the_routers_and_the_engines_prometheus_names_pass_promtools_lint(
    buffer, toy_model_dir, start_service
) -> None:
    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    router = start_service("router", router_args(buffer, toy_model_dir, [engine.url]))
    wait_until(lambda: buffer.depth() >= 1, "a group put (every router series is there)", 60)
    for service in (router, engine):
        text = httpx.get(service.url + "/metrics", timeout=30).text
        assert "# TYPE" in text and promlint(text) == [], service.url


def group(group_id: str) -> SampleGroup:
    sample = Sample(
        prompt_ids=[1, 2],
        response_ids=[3],
        response_logprobs=[-0.5],
        loss_mask=[1],
        reward=1.0,
        weight_version=0,
    )
    return SampleGroup(
        group_id=group_id,
        prompt="p",
        label="l",
        samples=[sample],
        weight_version=0,
        created_at=time.time(),
    )


async def test_the_routers_buffer_depth_gauge_counts_what_the_status_api_counts(
    buffer: SampleBuffer,
) -> None:
    """3 groups put, all 3 consumed by the trainer, none acked yet (in training): the status
    API's and the dashboard's buffer depth is 0 (what --max-buffer-depth bounds), and so is
    Prometheus' `buffer_depth`; the 3 in training are `groups_unacked`."""
    aio = AsyncSampleBuffer(buffer.config)
    try:
        for _ in range(3):
            await aio.start_group()
        await aio.put_groups([group(f"p{k}") for k in range(3)])
        assert len(buffer.read_groups("trainer-0", 10, block_ms=None)) == 3
        buffer.incr_counter("groups_consumed", 3)
        gauges, _totals = await redis_gauges(aio)
        values = {name: series[()] for name, _help, series in gauges}
        assert (await aio.ledger()).buffered == 0  # what GET /rollout/status says
        assert values["buffer_depth"] == 0 and values["groups_unacked"] == 3
    finally:
        await aio.aclose()


def test_the_ledgers_drop_lines_say_groups_and_samples_apart() -> None:
    ledger = Ledger(
        generated=40,
        trained=33,
        dropped=7,
        dropped_groups={"reward_error": 7},
        dropped_samples={"reward_error": 187},
    )
    line = next(row for row in ledger.table().splitlines() if "reward_error" in row)
    assert line.split()[:2] == ["reward_error", "7"]
    assert "groups dropped whole; 187 samples dropped in all" in line
    assert "groups (187 samples)" not in line


FLAKY = '''
import asyncio
import itertools

calls = itertools.count()


async def flaky(text, label, stopped):
    """Of every 5 calls: one raises, one returns None, one outlasts --rm-timeout-s, two 1.0."""
    k = next(calls) % 5
    if k == 0:
        raise ValueError("no answer")
    if k == 2:
        await asyncio.sleep(30)
    return None if k == 1 else 1.0
'''


def test_a_reward_that_fails_on_60_percent_of_calls_is_said_with_its_share_each_step(
    buffer, toy_model_dir, start_service, engines, tmp_path, monkeypatch
) -> None:
    """The router publishes each rollout batch's reward failures and their share (timeouts
    apart); the console line of a trainer step says them, naming the router's log."""
    (tmp_path / "flaky_share.py").write_text(FLAKY)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{sys.path[0]}")
    flags = ["--custom-rm-path", "flaky_share:flaky", "--rm-workers", "0"]
    flags += ["--rm-timeout-s", "0.5", "--rm-max-errors-in-a-row", "0", "--eval-interval", "0"]
    flags += ["--max-staleness", "1000"]
    args = router_args(buffer, toy_model_dir, [engines().url], *flags, n=5)
    start_service("router", args)

    def batches() -> list[MetricsRecord]:
        return [r for _id, r in buffer.read_metrics() if "rollout/reward_mean" in r.values]

    router = wait_until(batches, "a rollout batch's record", 60)[0]
    assert router.values["rollout/reward_failures"] == 4 * 3  # 4 groups of 5, 3 failed each
    assert router.values["rollout/reward_failed_fraction"] == pytest.approx(0.6)
    assert router.values["rollout/reward_timeout_fraction"] == pytest.approx(0.2)
    progress = RunProgress(tmp_path)
    progress.add(router)
    line = progress.add(trainer_record(1))
    progress.close()
    assert line is not None
    assert "| reward errors 60% (" in line and "20% timed out: --rm-timeout-s" in line
    assert "see logs/router.log" in line
    (tmp_path / "quiet").mkdir()
    quiet = RunProgress(tmp_path / "quiet")  # a batch without a failure: not a word
    values = {**router.values, "rollout/reward_failures": 0.0}
    values["rollout/reward_failed_fraction"] = values["rollout/reward_timeout_fraction"] = 0.0
    quiet.add(MetricsRecord(source="router", step=0, values=values, time=time.time()))
    assert "reward errors" not in (quiet.add(trainer_record(1)) or "")
    quiet.close()


SINK = """
import sys, time
from pathlib import Path
from proto import MetricsRecord
from tandem.sinks import MetricSinks
sinks = MetricSinks(Path(sys.argv[1]), "tandem-test", {})
sinks.add(MetricsRecord(source="trainer", step=1, values={"train/loss": 1.0}, time=time.time()))
sinks.close()
"""


def test_wandb_without_a_login_says_how_to_log_in_or_run_offline(tmp_path) -> None:
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", SINK, str(tmp_path)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "W&B failed to start" in out.stdout, out.stdout + out.stderr
    assert "WANDB_MODE=offline" in out.stdout and "`wandb login`" in out.stdout


def test_the_faq_says_tandem_up_lets_engines_and_trainer_share_a_gpu() -> None:
    """As the code does (tandem up --engine-gpus 0 --trainer-gpus 0, said at start)."""
    faq = (ROOT / "docs" / "faq.md").read_text()
    assert "refuses a GPU" not in faq
    assert "--engine-gpus 0\n--trainer-gpus 0" in faq or "--engine-gpus 0 --trainer-gpus 0" in faq


def test_a_router_says_once_at_start_which_characters_its_tokenizer_turns_into_unk(
    buffer, toy_model_dir, start_service, engines, tmp_path
) -> None:
    """The toy tokenizer knows digits, '>' and '=': arithmetic prompts lost their '+' to
    <unk> without a word. The router's start-up notes (its log, tandem up's console) name the
    dataset, the rows and the characters."""
    rows = [{"prompt": "12+34=", "label": "46"}, {"prompt": "12>", "label": "21"}]
    rows.append({"prompt": "5+6-1=", "label": "10"})
    data = tmp_path / "sums.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    args = router_args(buffer, toy_model_dir, [engines().url], "--rm-type", "exact_match")
    router = start_service("router", [*args, "--prompt-data", str(data), "--no-rollout"])
    [note] = router.info["task_notes"]
    assert note.startswith(f"2 of 3 prompts of {data} hold text the model's tokenizer does not")
    assert "(the first: row 1; unknown: '+' (2x), '-' (1x))" in note and "'<unk>'" in note
    assert router.log().count("hold text the model's tokenizer does not know") == 1
