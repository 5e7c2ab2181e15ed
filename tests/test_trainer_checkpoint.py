"""Checkpoints: save + resume reproduces an uninterrupted run exactly; load errors are actionable."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from services.sample_buffer import SampleBuffer
from services.trainer.checkpoint import SaveError, saving
from services.trainer.ckpt_folder import TRACKER, resolve_iteration
from services.trainer.config import TrainerConfig, lineage_start
from tests.test_trainer_process import bind_pull, receive_version, run_trainer, sample_groups


def trainer_args(toy_model_dir: Path, buffer, endpoint: str) -> list[str]:  # type: ignore[no-untyped-def]
    return [
        "--model",
        str(toy_model_dir),
        "--redis-url",
        buffer.config.redis_url,
        "--run-id",
        buffer.config.run_id,
        "--weights-endpoint",
        endpoint,
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--read-block-ms",
        "200",
        "--max-staleness",
        "10",
        "--lr",
        "1e-2",
    ]


def final_weights(buffer, toy_model_dir: Path, runs: list[list[str]]) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Run the trainer processes in order; return the last version received."""
    sock, endpoint = bind_pull()
    tensors: dict[str, torch.Tensor] = {}
    try:
        for extra in runs:
            done = run_trainer([*trainer_args(toy_model_dir, buffer, endpoint), *extra])
            assert done.returncode == 0, done.stderr[-3000:]
            while True:
                try:
                    _, tensors = receive_version(sock)
                except Exception:
                    break
    finally:
        sock.close(linger=0)
    return tensors


@pytest.mark.slow
def test_save_and_resume_reproduce_an_uninterrupted_run_exactly(
    buffer, toy_model_dir: Path, tmp_path: Path
) -> None:
    groups = sample_groups(toy_model_dir, 6, 4, seed=3)
    for g in groups:
        buffer.put_group(g)
    straight = final_weights(buffer, toy_model_dir, [["--max-steps", "3"]])
    assert buffer.depth() == 0

    buffer.redis.delete(*buffer.redis.keys(f"tandem:{buffer.config.run_id}:*"))
    for g in groups:
        buffer.put_group(g)
    ckpt = tmp_path / "ckpt"
    resumed = final_weights(
        buffer,
        toy_model_dir,
        [
            ["--max-steps", "2", "--save", str(ckpt), "--save-interval", "1"],
            ["--max-steps", "3", "--load", str(ckpt)],
        ],
    )
    assert (ckpt / TRACKER).read_text().strip() == "2"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    assert buffer.depth() == 0 and buffer.drop_counts() == {}
    assert set(resumed) == set(straight)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    steps = [r.step for _, r in buffer.read_metrics() if r.source == "trainer"]
    assert steps == [1, 2, 3]


def test_loading_a_directory_without_a_tracker_says_what_it_expected(tmp_path: Path) -> None:
    (tmp_path / "something_else").mkdir()
    with pytest.raises(FileNotFoundError, match=TRACKER):
        resolve_iteration(tmp_path)
    (tmp_path / TRACKER).write_text("7")
    with pytest.raises(FileNotFoundError, match="iteration 7 has no checkpoint"):
        resolve_iteration(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_iteration(tmp_path / "missing")


def test_ckpt_step_picks_an_iteration_over_the_tracker(tmp_path: Path) -> None:
    for it in (3, 5):
        (tmp_path / f"iter_{it:07d}").mkdir()
        (tmp_path / f"iter_{it:07d}" / "metadata.json").write_text("{}")
    (tmp_path / TRACKER).write_text("5")
    assert resolve_iteration(tmp_path).name == "iter_0000005"
    assert resolve_iteration(tmp_path, ckpt_step=3).name == "iter_0000003"
    # (tandem convert's --ckpt-step -3 was taken for the latest)
    with pytest.raises(ValueError, match=r"--ckpt-step -3: at least 0, or -1 \(the latest\)"):
        resolve_iteration(tmp_path, ckpt_step=-3)


def test_the_trainer_cli_refuses_a_load_directory_without_a_checkpoint(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    done = run_trainer(
        [
            "--model",
            str(toy_model_dir),
            "--load",
            str(tmp_path),
            "--redis-url",
            "redis://127.0.0.1:1/0",
        ]
    )
    assert done.returncode != 0
    assert TRACKER in done.stderr and "--load" in done.stderr


def test_a_checkpoint_of_another_model_is_named_as_such_not_as_damaged(
    toy_model_dir: Path, tmp_path: Path, buffer
) -> None:
    """It was 'its files are cut short or damaged; go back to iteration N'."""
    from tandem.toy_model import write_toy_model

    ckpt = tmp_path / "ckpt"
    convert = [sys.executable, "-m", "tandem.cli", "convert", "hf-to-megatron"]
    subprocess.run([*convert, "--hf-dir", str(toy_model_dir), "--save", str(ckpt)], check=True)
    deeper = write_toy_model(tmp_path / "deeper", num_layers=3)
    done = run_trainer([*trainer_args(deeper, buffer, "tcp://127.0.0.1:9"), "--load", str(ckpt)])
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"checkpoint {ckpt / 'iter_0000000'} is not of this model" in last, last
    assert "shape mismatch" in last and "--model must have the shapes" in last


@pytest.mark.slow
def test_ppo_critic_state_is_saved_and_resumed_exactly(
    buffer, toy_model_dir: Path, tmp_path: Path
) -> None:
    groups = sample_groups(toy_model_dir, 6, 4, seed=4)
    gae = ["--advantage-estimator", "gae", "--lambd", "0.9"]
    for g in groups:
        buffer.put_group(g)
    straight = final_weights(buffer, toy_model_dir, [["--max-steps", "3", *gae]])
    buffer.redis.delete(*buffer.redis.keys(f"tandem:{buffer.config.run_id}:*"))
    for g in groups:
        buffer.put_group(g)
    ckpt = str(tmp_path / "ckpt")
    resumed = final_weights(
        buffer,
        toy_model_dir,
        [["--max-steps", "2", "--save", ckpt, *gae], ["--max-steps", "3", "--load", ckpt, *gae]],
    )
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


def test_pending_groups_a_loaded_checkpoint_already_trained_are_acked_not_trained(buffer) -> None:
    """The crash-between-save-and-ack case: the groups are still pending for the consumer, and
    the checkpoint lists them as trained; the next read acks them and hands out only the rest."""
    from services.trainer.config import TrainerConfig
    from services.trainer.intake import Limits
    from services.trainer.rollout import Intake
    from tests.test_trainer_batching import group

    for i in range(3):
        buffer.put_group(group(0, [0.0, 1.0], gid=f"g{i}"))
    pending = buffer.read_groups("trainer-0", 3, block_ms=100)  # read, never acked: a crash
    assert len(pending) == 3
    cfg = TrainerConfig(model="m", rollout_batch_size=2, read_block_ms=100)
    intake = Intake(cfg, buffer, Limits(1000, 1000, 1000), lambda *a, **k: None)
    intake.already_trained = {pending[0][0]}
    rollout = intake.read_rollout(0, lambda: False)
    assert rollout is not None
    assert [g.group_id for g in rollout.groups] == ["g1", "g2"]
    assert buffer.depth() == 2  # g0 acked (and deleted) without training
    assert buffer.drop_counts() == {}


def test_rng_state_loads_without_unpickling_and_restores_every_generator(tmp_path: Path) -> None:
    import random

    import numpy as np

    from services.trainer.checkpoint import _rng_state, _set_rng_state

    torch.save(_rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    _set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


def test_no_torch_load_in_the_project_unpickles() -> None:
    import ast

    root = Path(__file__).resolve().parents[1]
    unsafe = []
    for path in [*root.glob("services/**/*.py"), *root.glob("tandem/**/*.py")]:
        text = path.read_text()
        if "torch.load" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load"):
                continue
            flags = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if flags.get("weights_only") != "True":
                unsafe.append(f"{path.relative_to(root)}:{node.lineno}")
    assert unsafe == [], unsafe


def test_a_save_that_fails_names_the_version_the_folders_and_the_fix(monkeypatch) -> None:
    """A full disk (as megatron's writer, torch's distributed checkpoint or safetensors report
    it) and a folder not writable."""
    where = "--save /ckpt, --save-hf /hf"
    folders = {"--save": "/ckpt", "--save-hf": "/hf"}
    full = OSError(errno.ENOSPC, "No space left on device")
    # megatron's dist_checkpointing.save on a full disk: a BaseException, each rank's failure in it
    worker = RuntimeError("Worker failure: [Errno 28] No space left on device")
    torch_dcp = CheckpointException("write", {0: (worker, traceback.StackSummary())})
    for raised, said in (
        (full, "No space left on device"),
        (RuntimeError("I/O error: No space left on device (os error 28)\nmore"), "I/O error"),
        (torch_dcp, "Worker failure: [Errno 28] No space left on device"),
    ):
        with pytest.raises(SaveError) as caught, saving(7, folders):
            raise raised
        message = str(caught.value)
        assert message.startswith(f"could not save version 7 ({where}): "), message
        assert said in message.split(";")[0], message
        assert "the disk is full" in message and "\n" not in message
        assert "a resumed run (--load, or tandem up --resume RUN) trains them again" in message
    unwritable = "check that the folders exist and are writable"
    with pytest.raises(SaveError, match=unwritable), saving(7, folders):
        raise PermissionError(errno.EACCES, "Permission denied", "/ckpt")
    # torch's zip writer on a full disk (a 2.5 MB tmpfs) names no errno: the free space does
    torch_zip = RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    )
    worker = CheckpointException("write", {0: (torch_zip, traceback.StackSummary())})
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=3 << 20))
    with (
        pytest.raises(SaveError) as caught,
        saving(7, {"--save": "/ckpt/not/made", "--save-hf": ""}),
    ):
        raise worker
    assert str(caught.value).startswith(
        "could not save version 7 (--save /ckpt/not/made): [enforce"
    )
    assert "; the disk is full (/ckpt/not/made: 3 MiB free): free space there" in str(caught.value)


def test_going_back_to_an_older_checkpoint_needs_a_new_lineage_on_a_trained_run_only(
    buffer: SampleBuffer, tmp_path: Path
) -> None:
    """A trained run's groups after checkpoint 10 were acknowledged at its save: --ckpt-step 8
    is refused without --new-lineage, and with it begins after the published version; a new run
    may start from any checkpoint of a folder (nothing of it was acknowledged)."""
    (tmp_path / TRACKER).write_text("10")
    url, run_id = buffer.config.redis_url, buffer.config.run_id
    terms = {"save": str(tmp_path), "ckpt_step": 8, "redis_url": url, "run_id": run_id}
    back = TrainerConfig(**terms)
    assert lineage_start(back, buffer, resumed=True) == 0, "a new run"
    buffer.set_version("trainer", 12)  # trained past its newest checkpoint
    with pytest.raises(ValueError, match="--ckpt-step 8 goes back past this run's newest"):
        lineage_start(back, buffer, resumed=True)
    assert lineage_start(TrainerConfig(**terms, new_lineage=True), buffer, resumed=True) == 13
    newest = TrainerConfig(**terms | {"ckpt_step": -1})
    assert lineage_start(newest, buffer, resumed=True) == 0, "the newest"
