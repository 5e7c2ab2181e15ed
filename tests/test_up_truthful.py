"""`tandem up`'s console and run folder say what happened: optimizer settings given beside a
checkpoint, a launch's own steps apart from the run's iteration, a configuration error found
after start-up, and whether `--resume` would help. The real CLI, every service a real process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from tests.helpers import wait_until

pytestmark = pytest.mark.e2e


def up(run_dir: Path | None, *flags: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    where = ["--run-dir", str(run_dir)] if run_dir else []
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "up", *where, *flags],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,  # (a run without --run-dir makes its folder under runs/ there)
    )


def said(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def trainer_lrs(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/lr"] for r in rows if r["source"] == "trainer"}


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stdout.strip().splitlines()[-1]


def test_optimizer_settings_given_beside_a_checkpoint_are_used_said_and_recorded(
    tmp_path: Path,
) -> None:
    """`--resume RUN --lr 5e-4` kept the checkpoint's rate without a word while config.toml
    recorded 5e-4; AdamW's betas came back from the checkpoint the same way. Now each given
    setting replaces the checkpoint's, one console line each, and the run folder records the
    values used (so its config.toml repeats the run). A --load launch of that checkpoint keeps
    its settings where none is given (said), and counts its own steps, not the iteration."""
    run = tmp_path / "run"
    first = up(run, "--max-steps", "3", "--stop-accuracy", "0")
    assert first.returncode == 0, said(first)
    assert "continue it with tandem up --resume" in last_line(first)  # (a resume helps)
    # A new run given its checkpoints as --save went on from them (no --run-dir: nothing said).
    refused = up(None, "--save", str(run / "checkpoints"), "--max-steps", "3", cwd=tmp_path)
    assert refused.returncode == 2, said(refused)
    assert (
        f"checkpoint (iteration 3): a new run would go on from it, not from --model. Continue "
        f"that run with tandem up --resume {run}, start a new one from its weights with --load"
        in (refused.stderr)
    )
    assert not (tmp_path / "runs").exists(), "nothing started"

    resumed = up(
        None, "--resume", str(run), "--lr", "5e-4", "--adam-beta2", "0.99", "--max-steps", "5"
    )
    assert resumed.returncode == 0, said(resumed)
    assert "[up] the checkpoint's lr 0.001 -> 0.0005 (from --lr)" in resumed.stdout
    assert "[up] the checkpoint's adam_beta2 0.999 -> 0.99 (from --adam-beta2)" in resumed.stdout
    assert trainer_lrs(run) == {1: 1e-3, 2: 1e-3, 3: 1e-3, 4: 5e-4, 5: 5e-4}
    trainer = tomllib.loads((run / "config.toml").read_text())["trainer"]
    assert (trainer["lr"], trainer["adam_beta2"]) == (5e-4, 0.99)
    assert trainer["override_opt_param_scheduler"] is True
    iteration = run / "checkpoints" / "iter_0000005"
    common = torch.load(iteration / "common.pt", map_location="cpu", weights_only=True)
    group = common["optimizer"]["param_groups"][0]
    assert (group["lr"], group["betas"]) == (5e-4, (0.9, 0.99)), group
    assert (common["scheduler_config"]["lr"], common["scheduler_config"]["adam_beta2"]) == (
        5e-4,
        0.99,
    )
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_launch"]) == (5, 2)
    assert "max_steps: this launch: 2 steps, " in resumed.stdout
    assert "; the run: at iteration 5, " in resumed.stdout

    loaded_dir = tmp_path / "loaded"
    loaded = up(
        loaded_dir, "--load", str(run / "checkpoints"), "--max-steps", "7", "--stop-accuracy", "0"
    )
    assert loaded.returncode == 0, said(loaded)
    kept = "lr 0.0005 (not the default 0.001), adam_beta2 0.99 (not the default 0.999)"
    assert f"[up] from the checkpoint: {kept}; a setting given replaces its value" in loaded.stdout
    assert set(trainer_lrs(loaded_dir).items()) == {(6, 5e-4), (7, 5e-4)}
    assert tomllib.loads((loaded_dir / "config.toml").read_text())["trainer"]["lr"] == 5e-4
    summary = json.loads((loaded_dir / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_launch"]) == (7, 2)
    assert summary["samples_trained_this_launch"] == summary["samples_trained"] > 0
    assert "max_steps: this launch: 2 steps, " in loaded.stdout, loaded.stdout
    assert " 7 steps" not in loaded.stdout  # (it said so twice: at the start, in the summary)
    assert "training (no accuracy goal; stop at iteration 7, --max-steps)" in loaded.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_configuration_a_service_refuses_after_start_up_exits_2_without_suggesting_resume(
    tmp_path: Path,
) -> None:
    """The trainer refuses --trainer-gpus on a machine without CUDA once it starts (after the
    engines): tandem up exited 1 (`child_failed`) and suggested --resume, which repeats it."""
    run = up(tmp_path / "run", "--trainer-gpus", "0", "--max-steps", "2")
    assert run.returncode == 2, said(run)
    assert "[up] FAILED: trainer refused its configuration (exit 2) (log: " in run.stdout
    assert "names GPUs, but torch sees no CUDA device" in run.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["outcome"] == "config_error"
    assert "--resume" not in last_line(run)
    assert "fix the setting named above and start the run again" in last_line(run)


def test_a_run_its_time_limit_ends_suggests_resume(tmp_path: Path) -> None:
    run = up(tmp_path / "run", "--time-limit-s", "1", "--max-steps", "1000")
    assert run.returncode == 1, said(run)
    assert "time limit of 1s reached (--time-limit-s)" in run.stdout
    assert f"continue it with tandem up --resume {tmp_path / 'run'}" in last_line(run)


def test_a_router_restarted_into_a_configuration_error_ends_the_run_with_exit_2_at_once(
    tmp_path: Path,
) -> None:
    """A service that exits 2 mid-run refused its configuration (a port taken, a dataset row
    read late): a restart repeats it. The old code started the router again up to
    --router-restarts times, then exited 1 (`child_failed`)."""
    run_dir = tmp_path / "run"
    flags = ["--stop-accuracy", "0", "--max-steps", "100000", "--time-limit-s", "300"]
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    taken, metrics = socket.socket(), run_dir / "metrics.jsonl"
    try:
        wait_until(lambda: trainer_lrs(run_dir) if metrics.exists() else {}, "a step", 300)
        ready = json.loads((run_dir / "logs" / "router.ready.json").read_text())
        os.kill(ready["pid"], signal.SIGKILL)
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        wait_until(lambda: bound(taken, ready["port"]), "the router's port taken", 10)
        taken.listen()
        out, _ = run.communicate(timeout=300)
    finally:
        taken.close()
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 2, out[-3000:]
    assert "starting it again on port" in out and "restart 1 of 3" in out
    assert "restart 2 of 3" not in out, out[-3000:]
    assert "[up] FAILED: router refused its configuration (exit 2)" in out, out[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "config_error"


def bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:  # (the killed router's socket, until the kernel closes it)
        return False
    return True
