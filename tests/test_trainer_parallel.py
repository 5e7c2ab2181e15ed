"""torchrun (gloo) tensor and data parallelism reproduce the single-process run; checkpoints
reshard between TP=1 and TP=2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_trainer_checkpoint import trainer_args
from tests.test_trainer_process import TIMEOUT_S, bind_pull, receive_version, sample_groups

pytestmark = pytest.mark.slow


def run(buffer, toy_model_dir: Path, nproc: int, extra: list[str]) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "tandem.cli", "trainer"]
    if nproc > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "services.trainer",
        ]
    return subprocess.run(
        [*launcher, *extra], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )


def fresh_run(buffer, groups) -> None:  # type: ignore[no-untyped-def]
    keys = buffer.redis.keys(f"tandem:{buffer.config.run_id}:*")
    if keys:
        buffer.redis.delete(*keys)
    for g in groups:
        buffer.put_group(g)


def train(buffer, toy_model_dir: Path, groups, runs: list[tuple[int, list[str]]]):  # type: ignore[no-untyped-def]
    """(losses per step, final weights) of a sequence of trainer runs on `groups`."""
    fresh_run(buffer, groups)
    sock, endpoint = bind_pull()
    tensors: dict[str, torch.Tensor] = {}
    try:
        for nproc, extra in runs:
            done = run(
                buffer,
                toy_model_dir,
                nproc,
                [*trainer_args(toy_model_dir, buffer, endpoint), *extra],
            )
            assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
            while True:
                try:
                    _, tensors = receive_version(sock)
                except Exception:
                    break
    finally:
        sock.close(linger=0)
    losses = [r.values["train/loss"] for _, r in buffer.read_metrics() if r.source == "trainer"]
    return losses, tensors


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal up to float summation order. Adam divides by sqrt(v): a gradient entry near zero
    turns a 1e-9 reduction-order difference into up to ~lr-sized steps, so the bound is 1% of
    the test's learning rate (1e-2) per step, while the losses above agree to 1e-5 relative."""
    assert set(a) == set(b) and a
    worst = max(((a[n] - b[n]).abs().max().item(), n) for n in a)
    assert worst[0] < 2e-4, worst


def test_tp2_and_dp2_reproduce_single_process_losses_and_weights(
    buffer, toy_model_dir: Path
) -> None:
    groups = sample_groups(toy_model_dir, 4, 4, seed=5)
    ref_losses, ref_w = train(buffer, toy_model_dir, groups, [(1, ["--max-steps", "2"])])
    tp_losses, tp_w = train(
        buffer,
        toy_model_dir,
        groups,
        [(2, ["--max-steps", "2", "--tensor-model-parallel-size", "2"])],
    )
    dp_losses, dp_w = train(buffer, toy_model_dir, groups, [(2, ["--max-steps", "2"])])
    assert len(ref_losses) == 2
    assert tp_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    assert dp_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    assert_same(tp_w, ref_w)
    assert_same(dp_w, ref_w)


@pytest.mark.parametrize(("save_tp", "load_tp"), [(1, 2), (2, 1)])
def test_a_checkpoint_saved_at_one_tp_size_resumes_at_another(
    buffer, toy_model_dir: Path, tmp_path: Path, save_tp: int, load_tp: int
) -> None:
    groups = sample_groups(toy_model_dir, 4, 4, seed=6)
    _, straight = train(buffer, toy_model_dir, groups, [(1, ["--max-steps", "2"])])
    ckpt = str(tmp_path / "ckpt")
    runs = [
        (
            save_tp,
            ["--max-steps", "1", "--save", ckpt, "--tensor-model-parallel-size", str(save_tp)],
        ),
        (
            load_tp,
            ["--max-steps", "2", "--load", ckpt, "--tensor-model-parallel-size", str(load_tp)],
        ),
    ]
    _, resumed = train(buffer, toy_model_dir, groups, runs)
    assert_same(resumed, straight)


@pytest.mark.parametrize(
    ("name", "parallel"),
    [
        ("qwen3_untied", ["--tensor-model-parallel-size", "2"]),
        ("qwen3_moe", ["--max-tokens-per-gpu", "8192"]),  # data parallel
        ("qwen3_moe", ["--expert-model-parallel-size", "2"]),
        ("qwen3_moe", ["--expert-model-parallel-size", "2", "--max-tokens-per-gpu", "20"]),
    ],
)
def test_qwen3_under_tp2_and_qwen3_moe_under_dp2_or_ep2_reproduce_single_process_losses_and_weights(
    buffer, tmp_path: Path, name: str, parallel: list[str]
) -> None:
    from tests.tiny_models import write_tiny

    model_dir = write_tiny(tmp_path / name, name)
    groups = sample_groups(model_dir, 4, 4, seed=5)
    ref_losses, ref_w = train(buffer, model_dir, groups, [(1, ["--max-steps", "2"])])
    par_losses, par_w = train(buffer, model_dir, groups, [(2, ["--max-steps", "2", *parallel])])
    assert len(ref_losses) == 2
    assert par_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    assert_same(par_w, ref_w)


def test_an_moe_model_under_tensor_parallelism_is_refused_pointing_at_expert_parallelism(
    tmp_path: Path,
) -> None:
    from tests.tiny_models import write_tiny

    model_dir = write_tiny(tmp_path / "moe", "qwen3_moe")
    done = run(None, model_dir, 1, ["--model", str(model_dir), "--tensor-model-parallel-size", "2"])
    assert done.returncode == 2
    assert "--expert-model-parallel-size" in done.stderr
    args = ["--expert-model-parallel-size", "2", "--no-use-dynamic-batch-size"]
    done = run(None, model_dir, 1, ["--model", str(model_dir), *args])
    assert done.returncode == 2
    assert "--expert-model-parallel-size > 1 needs --use-dynamic-batch-size" in done.stderr


@pytest.mark.parametrize(("save_ep", "load_ep"), [(2, 2), (1, 1)])
def test_an_moe_checkpoint_saved_under_expert_parallelism_resumes_at_another_size(
    buffer, tmp_path: Path, save_ep: int, load_ep: int
) -> None:
    from tests.tiny_models import write_tiny

    model_dir = write_tiny(tmp_path / "moe", "qwen3_moe")
    groups = sample_groups(model_dir, 4, 4, seed=6)
    _, straight = train(buffer, model_dir, groups, [(1, ["--max-steps", "2"])])
    ckpt = str(tmp_path / "ckpt")
    runs = [
        (
            save_ep,
            ["--max-steps", "1", "--save", ckpt, "--expert-model-parallel-size", str(save_ep)],
        ),
        (
            load_ep,
            ["--max-steps", "2", "--load", ckpt, "--expert-model-parallel-size", str(load_ep)],
        ),
    ]
    _, resumed = train(buffer, model_dir, groups, runs)
    assert_same(resumed, straight)


def test_an_moe_checkpoint_refuses_to_resume_at_another_expert_parallel_size(
    buffer, tmp_path: Path
) -> None:
    from tests.tiny_models import write_tiny

    model_dir = write_tiny(tmp_path / "moe", "qwen3_moe")
    fresh_run(buffer, sample_groups(model_dir, 4, 4, seed=6))
    ckpt = str(tmp_path / "ckpt")
    args = trainer_args(model_dir, buffer, "")
    done = run(
        buffer,
        model_dir,
        2,
        [*args, "--max-steps", "1", "--save", ckpt, "--expert-model-parallel-size", "2"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    done = run(buffer, model_dir, 1, [*args, "--max-steps", "2", "--load", ckpt])
    assert done.returncode == 2
    assert "saved at --expert-model-parallel-size 2: resume at the same size" in done.stderr


def test_a_converted_moe_checkpoint_loads_under_expert_parallelism(buffer, tmp_path: Path) -> None:
    """Weights only (`tandem convert`, saved at EP 1) reshard to EP 2."""
    from tests.tiny_models import write_tiny

    model_dir = write_tiny(tmp_path / "moe", "qwen3_moe")
    other = write_tiny(tmp_path / "other", "qwen3_moe", seed=1)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.trainer.convert",
            "hf-to-megatron",
            "--hf-dir",
            str(other),
            "--save",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    groups = sample_groups(other, 4, 4, seed=6)
    ep2 = ["--max-steps", "1", "--expert-model-parallel-size", "2"]
    _, loaded = train(buffer, model_dir, groups, [(2, [*ep2, "--load", str(tmp_path / "c")])])
    _, direct = train(buffer, other, groups, [(2, ep2)])
    assert_same(loaded, direct)
