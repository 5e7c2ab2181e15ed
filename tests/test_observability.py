"""What an operator sees: Prometheus `/metrics` on every service, TensorBoard files, the
`tandem metrics` reader and the run's Chrome-trace timeline.

One real `tandem up` run (Redis, an engine, broker, router, trainer as processes) serves the
module: the services are scraped while it trains, then it is stopped with Ctrl-C (exit code
130, every child stopped) and its run folder is read back.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from services.sample_buffer import SampleBuffer
from services.sample_buffer.timeline import Timeline, chrome_trace, read_spans
from tandem import metrics_cli, timeline_cli
from tandem.tensorboard import EventWriter, crc32c
from tests.helpers import wait_until
from tests.tensorboard_events import read_scalars

# One sample line of the text format: name, optional {labels}, value (no timestamps here).
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
VALUE = r"(?:[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+)|NaN|[-+]Inf)"
SAMPLE = re.compile(rf"^({NAME})(?:\{{({LABEL}(?:,{LABEL})*)?\}})? ({VALUE})$")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def parse_prometheus(text: str) -> dict[str, float]:
    """Strict reading of the 0.0.4 text format: every line is HELP, TYPE or a sample of a
    family declared before it; histograms are cumulative and end in +Inf == _count. Returns
    {'name{labels}': value}."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert re.match(rf"^# HELP {NAME} \S", line), line
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            assert name not in types, f"{name} declared twice"
            types[name] = kind
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        name, labels, value = match.groups()
        family = (
            name if name in types else next(n for n in types if name in (n + s for s in SUFFIXES))
        )
        if types[family] == "counter":
            assert name.endswith("_total"), line
        key = f"{name}{{{labels}}}" if labels else name
        assert key not in samples, f"{key} twice"
        samples[key] = float(value.replace("Inf", "inf"))
    try:  # the official parser too, when it is installed
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        pass
    else:
        assert {f.name for f in text_string_to_metric_families(text)}
    for family in (n for n, kind in types.items() if kind == "histogram"):
        buckets = [v for k, v in samples.items() if k.startswith(family + "_bucket")]
        assert buckets == sorted(buckets), f"{family} buckets are not cumulative"
        assert buckets[-1] == samples[family + "_count"]
    return samples


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse_prometheus(resp.read().decode())


class Run:
    def __init__(self, run_dir: Path, proc: subprocess.Popen) -> None:
        self.run_dir, self.proc, self.output = run_dir, proc, ""
        self.children: list[psutil.Process] = []

    def urls(self) -> dict[str, str]:
        logs = self.run_dir / "logs"
        urls = {
            p.name.split(".")[0]: json.loads(p.read_text())["url"]
            for p in logs.glob("*.ready.json")
        }
        found = re.search(r"metrics at (http://\S+)/metrics", (logs / "trainer.log").read_text())
        return {**urls, "trainer": found.group(1)} if found else urls

    def trainer_steps(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return max((r["step"] for r in rows if r["source"] == "trainer"), default=0)

    def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
            self.output = self.proc.communicate(timeout=90)[0]
            assert self.proc.returncode == 130, self.output


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("obs") / "run"
    flags = ["--max-steps", "10000", "--stop-accuracy", "0", "--num-engines", "1"]
    flags += ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--save-interval", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "WANDB_PROJECT": "tandem-test", "WANDB_MODE": "offline"},
    )
    handle = Run(run_dir, proc)
    try:
        wait_until(lambda: proc.poll() is not None or handle.trainer_steps() >= 1, "step 1", 240)
        assert proc.poll() is None, proc.communicate()[0]
        handle.children = psutil.Process(proc.pid).children(recursive=True)
        yield handle
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()


@pytest.mark.e2e
def test_every_service_serves_prometheus_metrics_that_move_with_the_work(run: Run) -> None:
    urls = run.urls()
    assert set(urls) >= {"router", "engine0", "broker", "trainer"}, urls
    before = {name: scrape(url) for name, url in urls.items()}
    steps = run.trainer_steps()
    wait_until(lambda: run.trainer_steps() >= steps + 2, "two more trainer steps", 60)
    # The router may have sent the next batch's requests before `before` and wait for weights
    # now: the engine's and broker's counters move with the next sync, not with a step.
    for name, key in (
        ("engine0", "tandem_engine_requests_total"),
        ("broker", "tandem_broker_syncs_total"),
    ):
        moved = lambda n=name, k=key: scrape(urls[n])[k] > before[n][k]  # noqa: E731
        wait_until(moved, f"{name} {key} to move", 60)
    after = {name: scrape(url) for name, url in urls.items()}

    router = after["router"]
    for series in (
        "tandem_router_buffer_depth",
        "tandem_router_groups_unacked",
        "tandem_router_requests_in_flight",
        "tandem_router_groups_in_flight",
        "tandem_router_trainer_version",
        "tandem_router_engines_version",
        "tandem_router_staleness_versions",
        "tandem_router_rollout_idle_fraction",
        "tandem_router_request_seconds_count",
    ):
        assert series in router, series
    assert any(k.startswith("tandem_router_engine_weight_version{engine=") for k in router)
    assert 0 <= router["tandem_router_rollout_idle_fraction"] <= 1
    for moving in ("groups_put_total", "samples_generated_total", "tokens_generated_total"):
        key = "tandem_router_" + moving
        assert router[key] > before["router"].get(key, 0), key
    assert router["tandem_router_trainer_version"] >= steps + 2

    engine = after["engine0"]
    for key in ("tandem_engine_requests_total", "tandem_engine_generated_tokens_total"):
        assert engine[key] > before["engine0"][key], key
    assert engine["tandem_engine_generate_seconds_count"] == engine["tandem_engine_requests_total"]
    assert engine["tandem_engine_weight_version"] >= steps
    assert {"tandem_engine_running_sequences", "tandem_engine_queued_sequences"} <= set(engine)

    trainer = after["trainer"]
    assert (
        trainer["tandem_trainer_steps_total"] >= before["trainer"]["tandem_trainer_steps_total"] + 2
    )
    assert trainer["tandem_trainer_version"] >= steps + 2
    assert trainer["tandem_trainer_tokens_trained_total"] > 0
    assert trainer["tandem_trainer_step_seconds_count"] == trainer["tandem_trainer_steps_total"]
    assert 0 <= trainer["tandem_trainer_idle_fraction"] <= 1
    for gauge in ("loss", "reward_mean", "tokens_per_second", "last_step_seconds"):
        assert math.isfinite(trainer[f"tandem_trainer_{gauge}"]), gauge

    broker = after["broker"]
    assert broker["tandem_broker_syncs_total"] > before["broker"]["tandem_broker_syncs_total"]
    assert broker["tandem_broker_sync_seconds_count"] == broker["tandem_broker_syncs_total"]
    assert broker["tandem_broker_synced_bytes_total"] > 0


@pytest.mark.e2e
def test_ctrl_c_stops_every_service_and_leaves_tensorboard_scalars_and_a_timeline(
    run: Run,
) -> None:
    assert len(run.children) >= 5  # redis, engine, broker, router, trainer
    stopping = time.monotonic()
    run.stop()  # exit code 130
    # The trainer's last version does not wait (15 s) for engines that are stopping too.
    assert time.monotonic() - stopping < 12, run.output[-2000:]
    assert "waiting for trainer to stop" not in run.output, run.output[-2000:]
    # said at once (it said nothing until 5 s later, when services were slow to stop)
    assert "[up] interrupted: stopping every service (the router first; the trainer" in run.output
    wait_until(lambda: not [c for c in run.children if alive(c)], "every service to end", 10)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["outcome"] == "interrupted"
    # The step the trainer finished after the Ctrl-C is in the files (a resume reads on after
    # the stream's end: a record left unread then is never written).
    log = (run.run_dir / "logs" / "trainer.log").read_text()
    last = int(re.findall(r"stopped after \d+ steps at version (\d+)", log)[-1])
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if r["source"] == "trainer") == last == summary["steps"]
    (events,) = (run.run_dir / "tensorboard").glob("events.out.tfevents.*")
    scalars = read_scalars(events)  # checks each record's CRC-32C
    losses = [(step, v) for step, tag, v in scalars if tag == "train/loss"]
    assert len(losses) >= 3 and [s for s, _ in losses] == sorted(s for s, _ in losses)
    assert any(tag.startswith("rollout/") for _, tag, _ in scalars)
    try:  # the reader TensorBoard itself uses, when it is installed
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        pass
    else:
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([v for _, v in losses])

    text = (run.run_dir / "timeline.json").read_text()
    trace = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    events_x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events_x)
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    by_source: dict[str, set[str]] = {}
    for e in events_x:
        by_source.setdefault(names[e["pid"]], set()).add(re.sub(r" \d+$", "", e["name"]))
    assert {"rollout batch", "waiting_for_trainer"} <= by_source["router"], by_source
    assert {"wait for data", "step", "forward_backward", "optimizer", "publish"} <= by_source[
        "trainer"
    ]
    assert any(name.startswith("sync v") for name in by_source["broker"])

    # W&B: the project is named in the environment; without the package the run says so.
    try:
        import wandb  # noqa: F401
    except ImportError:
        assert "the wandb package is not installed: W&B off" in run.output
    else:  # WANDB_MODE=offline: the run's records are in its .wandb file (protobuf, raw strings)
        (records,) = (run.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
        assert "W&B run offline, in" in run.output
        data = records.read_bytes()
        assert all(s in data for s in (b"tandem-test", b"train/loss", b"rollout/", b"trainer/step"))


@pytest.mark.e2e
def test_tandem_metrics_and_timeline_read_a_finished_run_folder(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run.stop()
    assert metrics_cli.main([str(run.run_dir), "--json", "--source", "trainer"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) >= 3 and all("train/loss" in r for r in rows)
    out = tmp_path / "t.json"
    assert timeline_cli.main([str(run.run_dir), "-o", str(out)]) == 0
    assert "trainer" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["traceEvents"]) >= 10


def test_tandem_metrics_prints_the_stream_of_any_run(
    buffer: SampleBuffer, capsys: pytest.CaptureFixture[str]
) -> None:
    run_args = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    assert metrics_cli.main(run_args) == 1  # nothing published yet: said, not silent
    assert "no records" in capsys.readouterr().err
    buffer.publish_metrics("trainer", 1, {"train/loss": 0.5, "train/reward_mean": 0.25})
    buffer.publish_metrics("router", 1, {"rollout/samples_per_s": 12.0})
    assert metrics_cli.main([*run_args, "--keys", "train/*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert (
        "trainer" in lines[0]
        and "train/loss=0.5" in lines[0]
        and "train/reward_mean=0.25" in lines[0]
    )
    assert "router" in lines[1] and "samples_per_s" not in lines[1]
    assert metrics_cli.main([]) == 2


def test_tandem_metrics_into_a_reader_that_stops_early_ends_quietly_with_exit_0(
    buffer: SampleBuffer,
) -> None:
    pipe = buffer.redis.pipeline(transaction=False)
    for step in range(3000):  # (more than a pipe holds: writes go on after the reader has left)
        pipe.xadd(buffer.metrics_key, buffer.metrics_entry("trainer", step, {"train/loss": 0.5}))
    pipe.execute()
    run_args = f"--redis-url {buffer.config.redis_url} --run-id {buffer.config.run_id}"
    command = (
        f"{sys.executable} -m tandem.cli metrics {run_args} | head -1; exit ${{PIPESTATUS[0]}}"
    )
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("\n") == 1 and "train/loss=0.5" in done.stdout
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_timeline_spans_written_by_a_service_come_back_as_a_chrome_trace(
    buffer: SampleBuffer,
) -> None:
    timeline = Timeline(buffer.redis, buffer.config.run_id, "trainer", flush_s=0.05)
    with timeline.span("step 1", "steps", loss=math.nan):
        time.sleep(0.01)
    timeline.add("sync v1", 100.0, 100.5, "http://e0")
    timeline.close()
    spans = read_spans(buffer.redis, buffer.config.run_id)
    assert [s["name"] for s in spans] == ["step 1", "sync v1"]
    assert spans[0]["args"] == {"loss": None}  # strict JSON: no NaN
    trace = chrome_trace(spans)["traceEvents"]
    (sync,) = [e for e in trace if e["name"] == "sync v1"]
    assert sync["ts"] == 0 and sync["dur"] == 500_000.0  # microseconds from the first span


def test_tandem_timeline_names_an_output_it_cannot_write(
    buffer: SampleBuffer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timeline = Timeline(buffer.redis, buffer.config.run_id, "trainer")
    timeline.add("step 1", 1.0, 2.0)
    timeline.close()
    run_args = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    missing = tmp_path / "no-such-folder" / "t.json"
    assert timeline_cli.main([*run_args, "-o", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem timeline: cannot write --output {missing}: ") and "Errno" in err


def test_tandem_timeline_to_standard_output_writes_the_trace_there(
    buffer: SampleBuffer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """`-o -` wrote a file named '-'."""
    timeline = Timeline(buffer.redis, buffer.config.run_id, "trainer")
    timeline.add("step 1", 1.0, 2.0)
    timeline.close()
    monkeypatch.chdir(tmp_path)
    run_args = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    assert timeline_cli.main([*run_args, "-o", "-"]) == 0
    said = capsys.readouterr()
    assert "step 1" in [e["name"] for e in json.loads(said.out)["traceEvents"]]
    assert "1 spans (1 trainer)" in said.err and not (tmp_path / "-").exists()


def test_the_read_commands_name_a_redis_url_they_cannot_use(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`tandem ledger|metrics|timeline --redis-url host:6379` ended in redis-py's traceback."""
    from tandem import ledger_cli

    for name, command in (
        ("ledger", ledger_cli),
        ("metrics", metrics_cli),
        ("timeline", timeline_cli),
    ):
        assert command.main(["--redis-url", "host:6379", "--run-id", "r"]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"tandem {name}: --redis-url 'host:6379': "), err
        assert "(e.g. redis://127.0.0.1:6379/0)" in err


def test_crc32c_is_the_castagnoli_checksum_tensorboard_expects() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value


def test_a_refused_start_or_resume_leaves_no_tensorboard_file_or_wandb_run_of_nothing(
    tmp_path: Path,
) -> None:
    """A run refused once it had started (its Redis up, the model written) left an events file
    holding no scalar in RUN_DIR/tensorboard: TensorBoard listed a run of nothing, one more at
    each refused resume. The file is made with the first scalar."""
    writer = EventWriter(tmp_path / "tb")
    writer.close()
    assert not (tmp_path / "tb").exists()
    writer = EventWriter(tmp_path / "tb")
    writer.add_scalars(3, {"train/loss": 1.5}, wall_time=0.0)
    writer.close()
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert read_scalars(events) == [(3, "train/loss", 1.5)]

    def up(*flags: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "tandem.cli", "up", *flags]
        env = {**os.environ, "WANDB_PROJECT": "tandem-test", "WANDB_MODE": "offline"}
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)

    run = tmp_path / "run"  # refused by the router once the toy model (64 positions) is written
    new = up("--run-dir", str(run), "--rollout-max-response-len", "64")
    assert new.returncode == 2, new.stdout[-3000:] + new.stderr[-3000:]
    assert "the model's context is 64 positions" in new.stdout
    assert (run / "up_config.json").is_file() and not (run / "tensorboard").exists()
    # a resume refused by the trainer's check of the checkpoint it would go on from
    (run / "checkpoints").mkdir(exist_ok=True)  # (the refused start checked it writable)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    resumed = up("--resume", str(run), "--rollout-max-response-len", "0")
    assert resumed.returncode == 2, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "iteration 1 has no checkpoint" in resumed.stdout
    assert "the resume did not start" in resumed.stdout and not (run / "tensorboard").exists()
    assert not (run / "wandb").exists(), "a W&B run of nothing (it is opened with the first record)"


def test_a_read_command_killed_with_sigkill_takes_its_private_redis_with_it(
    tmp_path: Path,
) -> None:
    """`tandem metrics/timeline/ledger RUN` start a server on a finished run's saved data; a
    command killed outright must not leave it running (the orphan held the folder's AOF)."""
    (tmp_path / "redis").mkdir()
    info = {"url": "redis://127.0.0.1:1/0", "run_id": "r", "own": True}  # gone: nothing answers
    (tmp_path / "redis.json").write_text(json.dumps(info))
    code = (
        "import argparse, time\n"
        "from tandem.run_redis import open_run\n"
        f"args = argparse.Namespace(run_dir={str(tmp_path)!r}, redis_url='', run_id='')\n"
        "with open_run(args) as (client, run_id, where):\n"
        "    print(client.info('server')['process_id'], flush=True)\n"
        "    time.sleep(120)\n"
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    try:
        server = psutil.Process(int(reader.stdout.readline()))  # type: ignore[union-attr]
        assert server.is_running() and "server" in server.name()
    finally:
        reader.kill()
        reader.wait(timeout=10)

    def gone() -> bool:
        try:
            return not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        wait_until(gone, "the private Redis gone with its command", timeout_s=15)
    finally:
        if not gone():
            server.kill()


def test_a_metrics_port_that_is_taken_is_named_as_the_flag() -> None:
    """The trainer's --metrics-port taken by another process ended it with an OSError's
    traceback (exit 1): a ListenError now, exit 2 naming --metrics-port."""
    from services.common.metrics import serve_metrics
    from services.common.serving import ListenError, bind_socket

    taken = bind_socket("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(
            ListenError,
            match=f"port {port} on 127.0.0.1 is already in use; pick another with --metrics-port",
        ):
            serve_metrics("127.0.0.1", port, lambda: "")
    finally:
        taken.close()
    server = serve_metrics("127.0.0.1", 0, lambda: "tandem_up 1\n")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert urllib.request.urlopen(url, timeout=10).read() == b"tandem_up 1\n"
    finally:
        server.shutdown()
        server.server_close()
