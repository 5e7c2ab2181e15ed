"""`tandem up` as a user runs it: the real CLI, every service a real process.

These are the slowest tests (each starts Redis, two engines, broker, router and trainer).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from services.sample_buffer import BufferConfig, SampleBuffer
from tandem.run_redis import REDIS_FILE
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e


def run_up(run_dir: Path, *flags: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def service_pids(run_dir: Path) -> dict[str, int]:
    logs = run_dir / "logs"
    return {
        p.name.split(".")[0]: json.loads(p.read_text())["pid"] for p in logs.glob("*.ready.json")
    }


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trainer_pids(run: subprocess.Popen) -> set[int]:
    """The pids of a running `tandem up`'s trainer processes (once its trainer has started)."""
    pids: set[int] = set()
    for child in psutil.Process(run.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "trainer" in child.cmdline()[:4]:
                pids.add(child.pid)
    return pids


def test_a_short_run_changes_the_engines_weights_and_raises_the_reward(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    flags = ("--max-steps", "30", "--stop-accuracy", "0", "--seed", "3")
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # (its trainer's pids name its weight slots: other tests' runs may have theirs)
        trainers = wait_until(lambda: trainer_pids(run), "the trainer started", 300)
        stdout, stderr = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    result = subprocess.CompletedProcess(cmd, run.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "max_steps"
    assert summary["steps"] == 30
    # Both engines serve the trainer's last version: the weights moved through the broker.
    assert summary["engine_weight_versions"] == ["30", "30"]
    # Same weights at step 0: the trainer's log-probs equal the engine's.
    assert summary["logprob_abs_diff_max_step0"] < 1e-3
    rows = metrics(run_dir)
    rewards = [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]
    assert len(rewards) == 30
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.03, rewards
    # The router evaluated on weights newer than the initial ones.
    assert max(r["step"] for r in rows if "eval/accuracy" in r) >= 25
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    assert "step   30 |" in result.stdout
    assert "training (no accuracy goal; stop at iteration 30, --max-steps)" in result.stdout
    assert "held-out accuracy scores reverse_digits: 20 held-out digit pairs" in result.stdout
    assert "[engine]" in (run_dir / "config.toml").read_text()  # what every service ran with
    # The shared-memory weight slots do not outlive the run.
    assert not [p for pid in trainers for p in Path("/dev/shm").glob(f"tandem-weights-{pid}-*")]
    # Where every generated group went: written at exit, in the router's metrics, and balanced.
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["balanced"] and ledger["trained"] > 0 and ledger["violations"] == 0, ledger
    assert summary["ledger"] == ledger
    assert any("ledger/generated" in r for r in rows if r["source"] == "router")
    ledger_cmd = [sys.executable, "-m", "tandem.cli", "ledger", str(run_dir)]
    printed = subprocess.run(ledger_cmd, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and "balanced" in printed.stdout, printed.stdout + printed.stderr


def start_up_in_background(run_dir: Path, *flags: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "up",
            "--run-dir",
            str(run_dir),
            "--max-steps",
            "300",
            "--stop-accuracy",
            "0",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while len(service_pids(run_dir)) < 4 or not (run_dir / "metrics.jsonl").exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "tandem up did not start in 180 s"
        time.sleep(0.2)
    return proc


def test_environment_episodes_are_cut_to_what_the_trainer_takes_from_the_first_one(
    tmp_path: Path,
) -> None:
    """The guessing game's episodes grow to ~60 tokens in 12 turns; the trainer takes 13. The
    router cuts each where the trainer's limits end, the first ones too (tandem up states the
    limits before the router starts): all trained, none dead-lettered as too_long."""
    from services.sample_buffer.server import _free_port

    port = _free_port("127.0.0.1")
    guess = Path(__file__).resolve().parents[1] / "examples" / "guess_env.py"
    env = subprocess.Popen(
        [sys.executable, str(guess), "--port", str(port)], stdout=subprocess.PIPE
    )
    try:
        assert env.stdout is not None and "guess env on" in env.stdout.readline().decode()
        flags = ["--env-url", f"http://127.0.0.1:{port}", "--num-engines", "1"]
        flags += ["--env-max-turns", "12", "--max-tokens-per-gpu", "12"]
        result = run_up(tmp_path / "run", *flags, "--max-steps", "3", "--stop-accuracy", "0")
    finally:
        env.terminate()
        env.wait()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "environment episodes are cut at 13 tokens, what the trainer takes" in result.stdout
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert ledger["balanced"] and ledger["trained"] == 3 * 64
    # (groups still in flight when the run stops are dropped as cancelled: none for length)
    assert set(ledger["dropped_groups"]) <= {"cancelled"}, ledger


def test_a_dying_service_stops_every_other_one_and_fails_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # (the broker, not started again: engines, the router and the broker are, by default,
    # test_up_recovery.py)
    proc = start_up_in_background(run_dir, "--broker-restarts", "0")
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(service_pids(run_dir)["broker"], signal.SIGKILL)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "broker was killed by SIGKILL (out of memory?)" in output
    wait_until(lambda: not [c for c in children if alive(c.pid)], "every service to end", 10)


def test_bad_flags_are_refused_before_anything_starts(tmp_path: Path) -> None:
    result = run_up(tmp_path / "run", "--model", str(tmp_path / "missing"), timeout_s=60)
    assert result.returncode == 2
    assert f"--model {tmp_path / 'missing'}: no such folder" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()
    (tmp_path / "file").write_text("")  # a run folder that cannot be made: a clear exit 2
    result = run_up(tmp_path / "file" / "run", timeout_s=60)
    assert result.returncode == 2, result.stderr
    assert f"--run-dir: cannot make {tmp_path / 'file' / 'run'}: Not a directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_held_out_prompts_given_to_the_router_that_cannot_be_read_are_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    """train-your-model.md gives them as --eval-prompt-data FILE: a missing file,
    or one whose rows lack the prompt's key, was found only by the router's start, once Redis
    and the engines were up (minutes, with a real model)."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "12>", "label": "21"}\n')
    (tmp_path / "eval.jsonl").write_text('{"question": "12>", "label": "21"}\n')
    flags = ("--prompt-data", str(data), "--rm-type", "exact_match", "--eval-prompt-data")
    for name, problem in (
        ("missing.jsonl", f"--eval-prompt-data {tmp_path / 'missing.jsonl'}: no such file"),
        ("eval.jsonl", f"{tmp_path / 'eval.jsonl'}: row 1 has no 'prompt' (--input-key"),
    ):
        given = str(tmp_path / name)
        result = run_up(tmp_path / "run", *flags, given, timeout_s=120)
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
        assert f"tandem up: router: {problem}" in result.stderr
        assert not (tmp_path / "run" / "logs").exists(), "nothing started"


def test_samples_longer_than_the_trainer_takes_fail_the_start_with_exit_code_2(
    tmp_path: Path,
) -> None:
    """train-your-model.md: such a run is refused, and a refused configuration exits 2 (it
    exited 1, the code of a failure at run time)."""
    result = run_up(tmp_path / "run", "--max-tokens-per-gpu", "4", timeout_s=300)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-2000:]
    assert "FAILED: the router's samples may reach 8 tokens" in result.stdout
    assert "(tandem up --max-tokens-per-gpu 7)" in result.stdout


def test_the_loop_also_runs_with_the_nccl_weight_transport_on_gloo(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Synchronous (max staleness 0): every step trains on samples of the trainer's own version,
    # so every step checks that the engines got exactly the trainer's weights.
    result = run_up(
        run_dir,
        "--max-steps",
        "8",
        "--stop-accuracy",
        "0",
        "--weight-transport",
        "nccl",
        "--max-staleness",
        "0",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine_weight_versions"] == ["8", "8"]
    assert summary["logprob_abs_diff_max_step0"] < 1e-3
    assert summary["steps_with_same_version_samples"] == 8
    assert summary["logprob_abs_diff_max_same_version"] < 1e-3
    broker_log = (run_dir / "logs" / "broker.log").read_text()
    assert "NCCL control at" in broker_log and "version 8 on 2 engines" in broker_log


@pytest.mark.slow
def test_a_tensor_parallel_trainer_under_torchrun_syncs_engines_by_broadcast(
    tmp_path: Path,
) -> None:
    """The four-GPU topology in miniature: TP=2 trainer (torchrun, gloo), two engines, the
    broker's NCCL transport (gloo on CPU) broadcasting from trainer rank 0. Mid-run the
    trainer is asked to send its version again (as a restarted broker asks): every rank joins
    the collective export and the run goes on."""
    run_dir = tmp_path / "run"
    flags = ["--max-steps", "6", "--stop-accuracy", "0", "--weight-transport", "nccl"]
    flags += ["--trainer-procs", "2", "--tensor-model-parallel-size", "2"]
    command = [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags]
    console = tmp_path / "console.txt"
    with console.open("w") as out:
        proc = subprocess.Popen([*command, "--max-staleness", "0"], stdout=out, stderr=out)
    trainer_log, asked = run_dir / "logs" / "trainer.log", "again: re-sending"
    try:
        wait_until(lambda: (run_dir / REDIS_FILE).exists() or proc.poll() is not None, "Redis")
        assert proc.poll() is None, console.read_text()
        where = json.loads((run_dir / REDIS_FILE).read_text())
        buffer = SampleBuffer(BufferConfig(redis_url=where["url"], run_id=where["run_id"]))

        def resent() -> bool:  # ask for whatever version the trainer is at, until it re-sends
            if (version := buffer.get_version("trainer")) >= 2:
                buffer.set_version("resend", version)
            done = proc.poll() is not None
            return done or (
                trainer_log.exists() and asked in trainer_log.read_text(errors="replace")
            )

        wait_until(resent, "the trainer to re-send its version", 240)
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, console.read_text()[-3000:] + trainer_log.read_text()[-3000:]
    assert asked in trainer_log.read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine_weight_versions"] == ["6", "6"]
    assert summary["logprob_abs_diff_max_step0"] < 1e-3
    # After every sync the engines serve exactly the TP-gathered weights.
    assert summary["steps_with_same_version_samples"] == 6
    assert summary["logprob_abs_diff_max_same_version"] < 1e-3


def test_nccl_with_engines_on_cpu_and_the_trainer_on_a_gpu_is_refused(tmp_path: Path) -> None:
    result = run_up(
        tmp_path / "run", "--weight-transport", "nccl", "--trainer-gpus", "0", timeout_s=60
    )
    assert result.returncode == 2
    assert "--engine-device cuda" in result.stderr and "--weight-transport zmq" in result.stderr


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("qwen3_untied", []),
        ("mistral", []),
        (
            "qwen3_moe",  # with routing replay: engines report experts, the trainer uses them
            ["--return-routed-experts", "--use-routing-replay"],
        ),
    ],
)
def test_a_short_run_on_qwen3_mistral_and_qwen3_moe_keeps_trainer_and_engines_in_agreement(
    tmp_path: Path, name: str, extra: list[str]
) -> None:
    from tests.tiny_models import write_tiny

    model_dir = write_tiny(tmp_path / name, name)
    run_dir = tmp_path / "run"
    result = run_up(
        run_dir,
        "--model",
        str(model_dir),
        "--max-steps",
        "3",
        "--stop-accuracy",
        "0",
        "--max-staleness",
        "0",
        *extra,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    print(name, {k: v for k, v in summary.items() if k.startswith("logprob_abs_diff")})
    assert summary["engine_weight_versions"] == ["3", "3"]
    assert summary["logprob_abs_diff_max_step0"] < 1e-3
    assert summary["steps_with_same_version_samples"] == 3
    assert summary["logprob_abs_diff_max_same_version"] < 1e-3
    if extra:
        replayed = [
            r["train/routing_replay_fraction"]
            for r in metrics(run_dir)
            if "train/routing_replay_fraction" in r
        ]
        assert replayed == [1.0, 1.0, 1.0]
