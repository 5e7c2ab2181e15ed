"""Resume and the trained model coming out: a restart with the same --save goes on (and brings
the broker to the resumed version), the schedule flags on resume are applied or warned about,
and --save-hf writes a directory a real engine serves (real Valkey, real CLI subprocesses)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.trainer.ckpt_folder import TRACKER
from tests.test_trainer_checkpoint import trainer_args
from tests.test_trainer_process import bind_pull, receive_version, run_trainer, sample_groups


def drain(sock) -> list[int]:  # type: ignore[no-untyped-def]
    """Versions the broker stand-in received, in order."""
    versions = []
    while True:
        try:
            versions.append(receive_version(sock)[0])
        except Exception:
            return versions


def lr_of_step(buffer, step: int) -> float:  # type: ignore[no-untyped-def]
    (values,) = [r.values for _, r in buffer.read_metrics() if r.step == step]
    return values["train/lr"]


@pytest.mark.slow
def test_a_restart_with_the_same_save_dir_resumes_and_sends_the_resumed_version_first(
    buffer, toy_model_dir: Path, tmp_path: Path
) -> None:
    for g in sample_groups(toy_model_dir, 4, 4, seed=3):
        buffer.put_group(g)
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--keep-last-checkpoints", "1"]
    sock, endpoint = bind_pull()
    try:
        first = run_trainer(
            [*trainer_args(toy_model_dir, buffer, endpoint), *save, "--max-steps", "1"]
        )
        assert first.returncode == 0, first.stderr[-3000:]
        assert f"[trainer] saved iteration 1 ({ckpt})" in first.stdout
        assert drain(sock) == [1]
        assert buffer.counters()["groups_consumed"] == 2
        buffer.set_counter("groups_consumed", 99)  # the checkpoint's value wins on resume,
        buffer.incr_counter("groups_dead_lettered")  # plus the dead letters written since
        buffer.set_version("resend", 1)  # a broker started before it asked for version 1

        again = run_trainer(
            [*trainer_args(toy_model_dir, buffer, endpoint), *save, "--max-steps", "2"]
        )
        assert again.returncode == 0, again.stderr[-3000:]
        # the resumed version reaches the broker before training, once (that send answers
        # the broker's ask)
        assert drain(sock) == [1, 2]
        assert "asks for version 1 again" not in again.stdout
    finally:
        sock.close(linger=0)
    assert (
        f"[trainer] resuming from {ckpt} (iteration 1), found by --save; --no-resume starts over"
        in again.stdout
    )
    assert f"[trainer] resumed from iteration 1 ({ckpt})" in again.stdout
    assert (ckpt / TRACKER).read_text().strip() == "2"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002"]  # kept the last 1
    assert buffer.counters()["groups_consumed"] == 2 + 1 + 2
    assert [r.step for _, r in buffer.read_metrics() if r.source == "trainer"] == [1, 2]

    other_run = [*trainer_args(toy_model_dir, buffer, ""), *save, "--max-steps", "3"]
    other_run[other_run.index("--run-id") + 1] = "another-run"
    refused = run_trainer([*other_run, "--no-resume"])
    assert refused.returncode == 2
    assert "run id" in refused.stderr and "another --save directory" in refused.stderr
    assert (ckpt / TRACKER).read_text().strip() == "2"


def test_lr_on_resume_applies_with_override_opt_param_scheduler_and_warns_without_it(
    buffer, toy_model_dir: Path, tmp_path: Path
) -> None:
    for g in sample_groups(toy_model_dir, 6, 4, seed=4):
        buffer.put_group(g)
    save = ["--save", str(tmp_path / "ckpt")]
    args = trainer_args(toy_model_dir, buffer, "")  # --lr 1e-2
    done = run_trainer([*args, *save, "--max-steps", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert lr_of_step(buffer, 1) == 1e-2

    done = run_trainer([*args, *save, "--max-steps", "2", "--lr", "1e-3"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING: --lr 0.001 (checkpoint: 0.01) ignored" in done.stdout
    assert "--override-opt-param-scheduler" in done.stdout
    assert lr_of_step(buffer, 2) == 1e-2

    override = ["--max-steps", "3", "--lr", "1e-3", "--override-opt-param-scheduler"]
    done = run_trainer([*args, *save, *override])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stdout
    assert lr_of_step(buffer, 3) == 1e-3


def test_save_hf_writes_a_model_the_engine_serves_with_the_trainers_weights(
    buffer, toy_model_dir: Path, tmp_path: Path, start_service
) -> None:
    from safetensors.torch import load_file

    from tests.test_engine_weights import load_model, logprob_error, sample

    for g in sample_groups(toy_model_dir, 2, 4, seed=0):
        buffer.put_group(g)
    out, ckpt = tmp_path / "trained-hf", tmp_path / "ckpt"
    sock, endpoint = bind_pull()
    try:
        args = trainer_args(toy_model_dir, buffer, endpoint)
        done = run_trainer([*args, "--max-steps", "1", "--save-hf", str(out), "--save", str(ckpt)])
        assert done.returncode == 0, done.stderr[-3000:]
        version, published = receive_version(sock)
    finally:
        sock.close(linger=0)
    assert f"[trainer] wrote the Hugging Face model of version 1 to {out}" in done.stdout
    assert version == 1
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert not out.with_name(out.name + ".tmp").exists()
    written = load_file(out / "model.safetensors")
    assert set(written) == set(published)
    assert all(torch.equal(written[n], published[n]) for n in published)

    engine = start_service("engine", ["engine", "--model", str(out), "--port", "0"])
    result = sample(engine.url)
    assert logprob_error(load_model(out), result) < 1e-4  # transformers, teacher-forced
    assert logprob_error(load_model(toy_model_dir), result) > 1e-4  # the trained weights

    converted = tmp_path / "converted"
    cli = [sys.executable, "-m", "tandem.cli", "convert", "megatron-to-hf"]
    conv = subprocess.run(
        [*cli, "--load", str(ckpt), "--out", str(converted)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert conv.returncode == 0, conv.stderr[-3000:]
    assert (converted / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    assert load_file(converted / "model.safetensors").keys() == written.keys()
