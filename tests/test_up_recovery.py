"""`tandem up` after something went wrong: a run that stalls says why and stops, a run whose
Redis paused goes on, a run whose trainer was killed resumes with `--resume` and trains no
group twice, a run whose Redis died stops at once naming it.

Real processes throughout (Redis with its AOF in the run folder, engines, broker, router,
trainer); the slowest tests of the suite after the full demo run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import psutil
import pytest

from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e


def up(
    run_dir: Path, *flags: str, timeout_s: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=cwd,
    )


def start_up(run_dir: Path, *flags: str) -> subprocess.Popen:
    """`tandem up` in the background, its console captured (stdout and stderr)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def service_process(run: subprocess.Popen, name: str) -> psutil.Process | None:
    """The live process of service `name` of a `tandem up` run (by its ready file's flag)."""
    for child in psutil.Process(run.pid).children():
        with contextlib.suppress(psutil.Error):  # (a killed one, not yet reaped)
            if f"{name}.ready.json" in " ".join(child.cmdline()):
                return child
    return None


def restarts_told(out: str, run_dir: Path, name: str, flag: str, port: str) -> None:
    """The console of a run whose service `name` was killed, started again once on `port`,
    and killed again past `flag`'s bound of 1."""
    log = run_dir / "logs" / f"{name}.log"
    assert (
        f"{name} was killed by SIGKILL (out of memory?) (log: {log}); "
        f"starting it again on port {port} (restart 1 of 1, {flag})"
    ) in out
    assert f"{name} is up again (" in out
    assert f"{name} exited after 1 restarts ({flag})" in out
    assert f"FAILED: {name} was killed by SIGKILL (out of memory?)" in out


def redis_of(run: subprocess.Popen) -> psutil.Process:
    """The Redis server `tandem up` started for its run."""
    children = psutil.Process(run.pid).children(recursive=True)
    return next(c for c in children if c.name() in ("valkey-server", "redis-server"))


def trainer_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in rows if r["source"] == "trainer"), default=0)


def test_a_run_that_makes_no_progress_says_what_each_service_waits_for_and_fails(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    # No rollouts: the trainer waits for samples that never come.
    run = start_up(
        run_dir,
        "--no-rollout",
        "--stall-warn-s",
        "4",
        "--stall-fail-s",
        "12",
        "--stop-accuracy",
        "0",
        "--max-steps",
        "3",
    )
    # Meanwhile the run's writes (the dashboard's pause, the API's) take the token tandem up
    # keeps in the run folder, and a request without it is told where that is.
    ready = run_dir / "logs" / "router.ready.json"
    try:
        info = wait_until(lambda: ready.exists() and ready.read_text(), "the router", 180)
        url = json.loads(info)["url"]
        refused = httpx.post(f"{url}/rollout/pause")
        assert refused.status_code == 401 and "RUN_DIR/api_token" in refused.text
        token = (run_dir / "api_token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        assert httpx.post(f"{url}/rollout/pause", headers=headers).json() == {"paused": True}
    except BaseException:
        run.terminate()  # it stops its services
        run.communicate(timeout=60)
        raise
    out, _ = run.communicate(timeout=180)
    assert run.returncode == 1, out
    assert f"the token in {run_dir / 'api_token'}" in out
    assert f"model, untrained (no step ran) (Hugging Face, with tokenizer): {run_dir}" in out
    assert "no progress for" in out
    assert "trainer [waiting for samples" in out and "waits for sample groups: 0 of 64" in out
    assert "router [rollouts off" in out and "rollouts are off (--no-rollout)" in out
    assert "no new group in its hands; --stall-fail-s)" in out
    assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "stalled"


def test_a_killed_trainer_resumes_with_resume_and_no_group_is_trained_twice(
    tmp_path: Path,
) -> None:
    """The default run (toy task, seed 0), its Redis paused for 12 s at step 3, its trainer
    killed at step 7 and the run resumed, reaches 90% held-out accuracy (this is also the
    suite's check that the default run reaches its goal)."""
    run_dir = tmp_path / "run"
    first = start_up(run_dir, "--save-interval", "3", "--seed", "0", "--time-limit-s", "300")
    deadline = time.monotonic() + 240

    def wait_for_step(step: int) -> None:
        while trainer_steps(run_dir) < step:
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, f"the first run made no {step} steps in 240 s"
            time.sleep(0.2)

    wait_for_step(3)
    # Redis paused past the services' 10 s call timeout (a stalled host): the run waits for it,
    # says so, and goes on; the ledger below accounts for what the outage cost.
    redis = redis_of(first)
    redis.suspend()
    time.sleep(12)
    redis.resume()
    wait_for_step(7)
    trainer = next(
        c
        for c in psutil.Process(first.pid).children(recursive=True)
        if "trainer" in c.cmdline() and "tandem.cli" in " ".join(c.cmdline())
    )
    # Two checkpoints are saved by now; megatron's default would have spawned a Manager
    # process for their results, which a SIGKILL leaves running.
    left = trainer.children(recursive=True)
    assert not [" ".join(c.cmdline())[:200] for c in left], "the trainer starts no process"
    os.kill(trainer.pid, signal.SIGKILL)
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 1 and "FAILED: trainer was killed by SIGKILL" in output, output[
        -3000:
    ]
    assert "does not answer" in output and "Redis answers again after 1" in output, output

    second = up(run_dir, "--resume", str(run_dir), timeout_s=600)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "resumed from iteration" in trainer_log
    saved = tomllib.loads((run_dir / "config.toml").read_text())
    assert saved["trainer"]["lr"] == 1e-3, "the toy model's rate, resolved before the model path"
    assert json.loads((run_dir / "up_config.json").read_text())["stop_accuracy"] == 0.9
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "reached_accuracy"
    assert summary["accuracy_last"] >= 0.9
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*"))
    assert len(kept) == 2, (
        f"--keep-checkpoints 2 by default, of the {summary['steps']} steps: {kept}"
    )
    assert summary["trained_model"] and (Path(summary["trained_model"]) / "config.json").exists()
    assert (
        f"trained model (Hugging Face, with tokenizer): {summary['trained_model']}" in second.stdout
    )

    with RedisServer(log_dir=tmp_path / "redis-logs", data_dir=run_dir / "redis") as server:
        buffer = SampleBuffer(BufferConfig(redis_url=server.url, run_id=f"up-{run_dir.name}"))
        trained = buffer.trained()
        ledger = buffer.ledger(details=True)
    # Every generated group has one fate across the kill and the resume, checked at each step.
    assert ledger.balanced and ledger.violations == 0, ledger.table()
    assert ledger.as_dict() == json.loads((run_dir / "ledger.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    written = [r["step"] for r in rows if r["source"] == "trainer"]
    assert len(written) == len(set(written)), "a step trained again was written twice"
    steps = sorted(trained)
    assert steps == list(range(1, steps[-1] + 1)), "every step of the final lineage is recorded"
    ids = [group_id for step in steps for group_id in trained[step]]
    # Group ids name the prompt cursor (p0, p1, ...): had the resumed router drawn prompts from
    # the start again, the early ids would repeat here.
    assert len(ids) == len(set(ids)), "a group was trained twice in the final weights' lineage"


def test_a_resume_whose_redis_lost_the_runs_data_says_so_and_its_ledger_balances(
    tmp_path: Path,
) -> None:
    """The run folder's redis/ deleted (or its disk lost) between a run and its resume: the
    checkpoint trains on, and the new Redis's ledger counts from there (the trainer took the
    checkpoint's 128 consumed groups back into a ledger that never held them: unbalanced by
    that much at every step)."""
    run_dir = tmp_path / "run"
    first = up(run_dir, "--max-steps", "2", "--stop-accuracy", "0", timeout_s=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    shutil.rmtree(run_dir / "redis")
    second = up(run_dir, "--resume", str(run_dir), "--max-steps", "4", timeout_s=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
    assert "--resume: the run's Redis holds none of its history" in second.stdout
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert (
        "the buffer holds no record of the groups version 2 trained (nor of the 128 this "
        "checkpoint consumed): its Redis lost the run's data"
    ) in trainer_log
    assert "UNBALANCED" not in second.stdout + trainer_log
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["balanced"] and ledger["violations"] == 0 and ledger["trained"] == 128, ledger
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4


def test_a_run_given_relative_held_out_prompts_in_its_config_file_resumes_from_another_folder(
    tmp_path: Path,
) -> None:
    """A [router] table's file (the held-out prompts, as train-your-model.md's --config has it)
    given relative to the folder the run started in: the run folder's config.toml holds it
    absolute, so a resume from another folder finds it (its router refused to start there:
    "--eval-prompt-data data/eval.jsonl: no such file", exit 2)."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    elsewhere.mkdir()
    pairs = [f'{{"prompt": "{a}{b}>", "label": "{b}{a}"}}\n' for a in range(10) for b in range(10)]
    (project / "data" / "train.jsonl").write_text("".join(pairs[20:]))
    (project / "data" / "eval.jsonl").write_text("".join(pairs[:20]))
    (project / "run.toml").write_text(
        '[router]\nprompt_data = "data/train.jsonl"\nrm_type = "reverse_digits"\n'
        'eval_prompt_data = "data/eval.jsonl"\n'
    )
    run_dir = tmp_path / "run"
    flags = ("--stop-accuracy", "0", "--max-steps")
    first = up(run_dir, "--config", "run.toml", *flags, "2", timeout_s=300, cwd=project)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    recorded = (run_dir / "config.toml").read_text()
    assert f'eval_prompt_data = "{project / "data" / "eval.jsonl"}"' in recorded
    second = up(run_dir, "--resume", str(run_dir), *flags, "3", timeout_s=300, cwd=elsewhere)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_a_run_whose_redis_dies_stops_at_once_naming_it_and_where_its_data_is(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run = start_up(run_dir, "--no-rollout", "--stop-accuracy", "0")
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists():  # written once every service is up
        assert run.poll() is None, run.communicate()[0]
        assert time.monotonic() < deadline, "the services did not start in 120 s"
        time.sleep(0.2)
    # A second tandem up in the same folder (a resume typed too early) is refused at once.
    second = up(run_dir, "--resume", str(run_dir), timeout_s=60)
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"{run_dir} is in use by another tandem up (pid {run.pid})" in second.stderr
    redis = redis_of(run)
    redis.kill()
    killed = time.monotonic()
    output, _ = run.communicate(timeout=90)
    print(output[-2000:])
    assert run.returncode == 1, output[-3000:]
    assert f"FAILED: the run's Redis (pid {redis.pid}) exited with code -9" in output
    assert f"tandem up --resume {run_dir} goes on from there" in output
    assert "Traceback" not in output
    assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "redis_failed"
    assert time.monotonic() - killed < 60, "stopped within a minute of the kill"


def test_a_full_disk_stops_the_run_naming_it_and_after_freeing_space_resume_goes_on(
    tmp_path: Path,
) -> None:
    """The run folder on a 1.8 MB disk: it fills by the first checkpoint (model, checkpoint,
    Redis AOF, logs). Whichever write fails first (the checkpoint, the AOF, a log), the run
    stops naming the full disk, without a traceback; once there is room, --resume goes on
    (from the checkpoint, or with a new lineage when none was written) and loses nothing."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1800k", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        run_dir = disk / "run"
        flags = ["--stop-accuracy", "0", "--max-steps", "6", "--num-engines", "1"]
        # (a Redis that refuses writes waits for room, up to --stall-fail-s: 600 s by default)
        stall = ("--stall-warn-s", "10", "--stall-fail-s", "30")
        full = up(run_dir, *flags, "--save-interval", "2", *stall, timeout_s=300)
        print(full.stdout[-3000:])
        assert full.returncode == 1, full.stdout[-3000:] + full.stderr[-3000:]
        assert "Traceback" not in full.stderr, full.stderr[-3000:]
        assert full.stdout.count(f"the disk holding {run_dir} is full") == 1, full.stdout
        assert f"go on with tandem up --resume {run_dir}" in full.stdout

        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = up(run_dir, "--resume", str(run_dir), *flags, timeout_s=300)
        print(resumed.stdout[-2000:])
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["outcome"] == "max_steps" and summary["steps"] == 6
        ledger = summary["ledger"]
        assert ledger["balanced"] and ledger["violations"] == 0, ledger
        assert ledger["trained"] >= 4 * 64, "the resumed steps trained their groups"
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_redis_url_nobody_answers_fails_the_start_naming_the_flag(tmp_path: Path) -> None:
    url = "redis://127.0.0.1:1/0"
    result = up(tmp_path / "run", "--redis-url", url, "--startup-timeout-s", "2", timeout_s=60)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert f"FAILED: no Redis server answered at {url} within 2s" in out
    assert "check --redis-url or REDIS_URL" in out and "Traceback" not in out


@pytest.mark.parametrize("transport", ["zmq", "nccl"])
def test_an_engine_that_dies_mid_run_is_started_again_and_past_the_bound_the_run_ends(
    tmp_path: Path, transport: str
) -> None:
    """kill -9 of an engine (an engine OOM-killed): tandem up starts it again on its port, the
    router has it brought to the current weights and sends it requests again, the run trains
    on; a death past --engine-restarts ends the run naming it. No group is lost either way.
    With NCCL (over gloo here) the broker keeps no copy of the weights: it asks the trainer to
    send the version again (the run waited for ever: no engine, so no samples, so no version)."""
    run_dir = tmp_path / "run"
    flags = ("--engine-restarts", "1", "--stop-accuracy", "0", "--max-steps", "100000")
    # (one engine with NCCL: no other one serves, so no new version comes meanwhile)
    more = (
        "--weight-transport",
        transport,
        *(("--num-engines", "1") if transport == "nccl" else ()),
    )
    run = start_up(run_dir, *flags, "--time-limit-s", "300", *more)
    ready = run_dir / "logs" / "router.ready.json"

    def engine0() -> psutil.Process | None:
        return service_process(run, "engine0")

    try:
        wait_until(lambda: trainer_steps(run_dir) >= 2, "two steps", 180)
        router = json.loads(ready.read_text())["url"]
        first = engine0()
        assert first is not None
        url = json.loads((run_dir / "logs" / "engine0.ready.json").read_text())["url"]
        first.kill()
        wait_until(lambda: (e := engine0()) is not None and e.pid != first.pid, "a new engine0")

        def serving() -> bool:
            workers = httpx.get(f"{router}/workers").json()["workers"]
            again = next(w for w in workers if w["url"] == url)
            return again["healthy"] and again["weight_version"] > 2

        wait_until(serving, "engine0 back in the rotation at the current weights", 120)
        step = trainer_steps(run_dir)
        wait_until(lambda: trainer_steps(run_dir) >= step + 3, "steps after it", 120)
        engine0().kill()  # type: ignore[union-attr]
        out, _ = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.terminate()
            run.communicate(timeout=60)
    assert run.returncode == 1, out[-3000:]
    restarts_told(out, run_dir, "engine0", "--engine-restarts", url.rsplit(":", 1)[1])
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["balanced"] and ledger["violations"] == 0, ledger
    if transport == "nccl":
        trainer = (run_dir / "logs" / "trainer.log").read_text()
        assert "the broker asks for version" in trainer and "again: re-sending" in trainer


def test_a_router_or_broker_that_dies_mid_run_is_started_again_and_the_run_trains_on(
    tmp_path: Path,
) -> None:
    """kill -9 of the router (a router OOM-killed): tandem up starts it again on its port, out
    of the health checks until it is up; the new router drops the groups the dead one left in
    flight as cancelled, draws their prompts again, and the run trains on. Then kill -9 of the
    broker: started again on its port and weight intake, the engines reach later versions
    through it (before, every broker death ended the run). A router death past
    --router-restarts ends the run naming it. The ledger balances throughout."""
    run_dir = tmp_path / "run"
    flags = ("--router-restarts", "1", "--stop-accuracy", "0", "--max-steps", "100000")
    run = start_up(run_dir, *flags, "--time-limit-s", "300")
    ready = run_dir / "logs" / "router.ready.json"

    def router() -> psutil.Process | None:
        return service_process(run, "router")

    try:
        wait_until(lambda: trainer_steps(run_dir) >= 2, "two steps", 180)
        url = json.loads(ready.read_text())["url"]
        first = router()
        assert first is not None
        first.kill()
        wait_until(lambda: (r := router()) is not None and r.pid != first.pid, "a new router")
        wait_until(ready.exists, "the new router ready", 120)  # (its ready file: written anew)
        step = trainer_steps(run_dir)
        wait_until(lambda: trainer_steps(run_dir) >= step + 3, "steps after it", 120)
        broker = service_process(run, "broker")
        assert broker is not None
        broker_url = json.loads((run_dir / "logs" / "broker.ready.json").read_text())["url"]
        broker.kill()
        wait_until(
            lambda: (b := service_process(run, "broker")) is not None and b.pid != broker.pid,
            "a new broker",
        )
        step = trainer_steps(run_dir)

        def engines_past(version: int) -> bool:
            workers = httpx.get(f"{url}/workers").json()["workers"]
            return min(w["weight_version"] for w in workers) > version

        wait_until(lambda: engines_past(step + 1), "the engines on later versions", 120)
        router().kill()  # type: ignore[union-attr]
        out, _ = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.terminate()
            run.communicate(timeout=60)
    assert run.returncode == 1, out[-3000:]
    restarts_told(out, run_dir, "router", "--router-restarts", url.rsplit(":", 1)[1])
    assert "unhealthy" not in out, "not health-checked while it started again"
    broker_log = run_dir / "logs" / "broker.log"
    assert (
        f"broker was killed by SIGKILL (out of memory?) (log: {broker_log}); starting it again "
        f"on port {broker_url.rsplit(':', 1)[1]} (restart 1 of 3, --broker-restarts)"
    ) in out
    assert "broker is up again (" in out
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["balanced"] and ledger["violations"] == 0, ledger
    log = (run_dir / "logs" / "router.log").read_text()
    left = [
        int(line.split(" groups were in flight")[0].rsplit(" ", 1)[1])
        for line in log.splitlines()
        if "groups were in flight when the last router died" in line
    ]
    # the first router's groups in flight (none when it was waiting for the trainer) were
    # dropped by the second, each once; the second's are in flight at the end
    assert ledger["dropped_groups"].get("cancelled", 0) == sum(left), (left, ledger)
    # tandem up gave the killed router's lease up: the new one did not wait it out
    assert "router lease, held by" not in log


def test_a_damaged_checkpoint_is_named_and_the_run_goes_back_to_an_older_one_as_a_new_lineage(
    tmp_path: Path,
) -> None:
    """The newest checkpoint cut short: the resume fails naming it and the way back, before
    anything but Redis starts; going back without --new-lineage is refused as early (the later
    steps' groups are gone: the old code trained on and then stalled for good); with it the run
    goes on from the older weights, its ledger balanced, and the one-time flags are not kept
    for the next resume."""
    run_dir = tmp_path / "run"
    flags = ["--stop-accuracy", "0", "--num-engines", "1", "--save-interval", "2"]
    first = up(run_dir, *flags, "--max-steps", "4", timeout_s=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    newest = run_dir / "checkpoints" / "iter_0000004"
    for shard in newest.glob("*.distcp"):
        os.truncate(shard, 1000)

    more = ["--resume", str(run_dir), "--max-steps", "6"]
    damaged = up(run_dir, *more, timeout_s=300)
    assert damaged.returncode != 0, damaged.stdout[-3000:]
    assert f"checkpoint {newest} does not load" in damaged.stdout, damaged.stdout[-3000:]
    back = ["--ckpt-step", "2", "--new-lineage"]
    assert "--ckpt-step 2 --new-lineage" in damaged.stdout, damaged.stdout[-3000:]
    # found before the engines start (minutes for a real model), not when the trainer loads it
    assert "engines at" not in damaged.stdout and "__0_0.distcp holds 1000 bytes" in damaged.stdout

    refused = up(  # (--max-steps again: the refused resume above left the saved 4)
        run_dir, *more, "--ckpt-step", "2", timeout_s=300
    )
    assert refused.returncode != 0
    assert "--ckpt-step 2 goes back past this run's newest checkpoint (iteration 4" in (
        refused.stdout
    ), refused.stdout[-3000:]
    assert "engines at" not in refused.stdout

    rolled = up(run_dir, "--resume", str(run_dir), "--max-steps", "8", *back)
    assert rolled.returncode == 0, rolled.stdout[-3000:] + rolled.stderr[-3000:]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "--new-lineage: starting from iteration 2 as version 5" in trainer_log, trainer_log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "max_steps" and summary["steps"] == 8, summary
    assert summary["ledger"]["balanced"] and summary["ledger"]["violations"] == 0
    saved = tomllib.loads((run_dir / "config.toml").read_text())["trainer"]
    assert "ckpt_step" not in saved and "new_lineage" not in saved, "a later resume would go back"

    later = up(run_dir, "--resume", str(run_dir), "--max-steps", "10", timeout_s=300)
    assert later.returncode == 0, later.stdout[-3000:] + later.stderr[-3000:]
    assert "resumed from iteration 8" in (run_dir / "logs" / "trainer.log").read_text()
    # (the groups the abandoned lineage trained stay counted trained across this resume)
    ledger = json.loads((run_dir / "summary.json").read_text())["ledger"]
    assert ledger["balanced"] and ledger["violations"] == 0, ledger


def test_a_refused_resume_leaves_the_run_folders_saved_configuration_as_it_was(
    tmp_path: Path,
) -> None:
    """A resume refused once its Redis (the trainer's checkpoint check) or every service (the
    router's samples longer than the trainer takes) had started: the old launcher had already
    written its flags (--lr 0.005, --max-steps 4) into up_config.json and config.toml, so the
    next plain resume ran with the refused configuration."""
    run_dir = tmp_path / "run"
    flags = ["--stop-accuracy", "0", "--num-engines", "1", "--save-interval", "1"]
    first = up(run_dir, *flags, "--max-steps", "2", timeout_s=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = {name: (run_dir / name).read_bytes() for name in ("up_config.json", "config.toml")}
    more = ["--resume", str(run_dir), "--max-steps", "4", "--lr", "0.005"]
    for trainer_args, why in (
        ("--ckpt-step 1", "--ckpt-step 1 goes back past this run's newest checkpoint"),
        ("--max-tokens-per-gpu 4", "FAILED: the router's samples may reach 8 tokens"),
    ):
        refused = up(run_dir, *more, *trainer_args.split(), timeout_s=300)
        assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
        assert why in refused.stdout, refused.stdout[-3000:]
        for name, data in saved.items():
            assert (run_dir / name).read_bytes() == data, f"{name} changed by {trainer_args}"
        assert "the resume did not start: up_config.json and config.toml are as they were" in (
            refused.stdout
        )
    assert tomllib.loads(saved["config.toml"].decode())["trainer"]["lr"] == 1e-3


def test_a_resume_whose_new_lineage_starts_at_max_steps_is_refused_not_finished_untrained(
    tmp_path: Path,
) -> None:
    """A run killed before its first checkpoint (here: its checkpoints deleted) resumes as a
    new lineage from --model after its newest version: with --max-steps at or below that
    version the trainer stopped at once, and the old launcher said 'trainer finished 4 steps',
    exit 0, calling the untrained --model its trained model."""
    run_dir = tmp_path / "run"
    flags = ["--stop-accuracy", "0", "--num-engines", "1", "--save-interval", "0"]
    first = up(run_dir, *flags, "--max-steps", "3", timeout_s=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    shutil.rmtree(run_dir / "checkpoints")
    more = ["--resume", str(run_dir), "--new-lineage", "--max-steps", "4"]
    refused = up(run_dir, *more, timeout_s=300)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert (
        f"the trainer starts a new lineage at version 4 (its versions go on after the run's "
        f"newest, 3), and --max-steps 4 is the run's total: nothing to train; give a higher one "
        f"(tandem up --resume {run_dir} --max-steps 8)"
    ) in refused.stdout, refused.stdout[-3000:]
    assert "engines at" not in refused.stdout and "trainer finished" not in refused.stdout


def test_a_trainer_stopped_by_a_signal_of_someone_else_fails_the_run_and_resume_goes_on(
    tmp_path: Path,
) -> None:
    """SIGTERM to the trainer alone (docker stop, a scheduler): it saves and exits 0. The old
    launcher said `trainer finished 200 steps` and exited 0 at step ~100."""
    run_dir = tmp_path / "run"
    flags = ["--stop-accuracy", "0", "--num-engines", "1", "--max-steps", "200"]
    run = start_up(run_dir, *flags)
    wait_until(lambda: trainer_steps(run_dir) >= 3, "three steps", 120)
    children = psutil.Process(run.pid).children(recursive=True)
    next(c for c in children if c.cmdline()[2:4] == ["tandem.cli", "trainer"]).terminate()
    output, _ = run.communicate(timeout=120)
    assert run.returncode == 1, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "trainer_stopped" and summary["steps"] < 200, summary
    assert f"FAILED: the trainer stopped at step {summary['steps']} of --max-steps 200" in output
    resumed = up(run_dir, "--resume", str(run_dir), "--max-steps", str(summary["steps"] + 2))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"resumed from iteration {summary['steps']} " in trainer_log, "its save on SIGTERM"
