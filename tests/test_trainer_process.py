"""Process tests of `tandem trainer`: real Valkey, real CLI subprocess, a ZMQ PULL socket standing
in for the weight broker, and reference log-probs from `transformers` standing in for the engine."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from proto import Sample, SampleGroup
from services.weight_sync.wire import bucket_tensors, parse_bucket

TIMEOUT_S = 180


def sample_groups(
    model_dir: Path, n_groups: int, n_samples: int, weight_version: int = 0, seed: int = 0
) -> list[SampleGroup]:
    """Groups of the reverse-digits task sampled from the HF model at temperature 1, with the
    log-probs a `transformers` engine reports (teacher-forced over the same tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        a, b = rng.randrange(10), rng.randrange(10)
        prompt_ids = [1, 4 + a, 4 + b, 14]
        samples = []
        for _ in range(n_samples):
            ids = list(prompt_ids)
            with torch.no_grad():
                for _ in range(rng.randrange(1, 5)):
                    probs = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
                    ids.append(int(torch.multinomial(probs, 1, generator=gen)))
                logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            response = ids[len(prompt_ids) :]
            logprobs = [float(logits[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(response)]
            reward = (
                sum(1.0 for i, d in enumerate((b, a)) if i < len(response) and response[i] == 4 + d)
                / 3
            )
            samples.append(
                Sample(
                    prompt_ids=prompt_ids,
                    response_ids=response,
                    response_logprobs=logprobs,
                    loss_mask=[1] * len(response),
                    reward=reward,
                    weight_version=weight_version,
                )
            )
        groups.append(
            SampleGroup(
                group_id=f"g{g}",
                prompt=f"{a}{b}>",
                label=f"{b}{a}",
                samples=samples,
                weight_version=weight_version,
                created_at=time.time(),
            )
        )
    return groups


def run_trainer(args: list[str], timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "trainer", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


def bind_pull() -> tuple[zmq.Socket, str]:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVTIMEO, 1000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def receive_version(sock: zmq.Socket) -> tuple[int, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    received, expected, version = 0, None, -1
    while expected is None or received < expected:
        header, frames = parse_bucket(sock.recv_multipart())
        version, expected = header.version, header.num_buckets
        received += 1
        tensors.update({n: t.clone() for n, t in bucket_tensors(header, frames)})
    return version, tensors


def common_args(toy_model_dir: Path, buffer, endpoint: str = "") -> list[str]:  # type: ignore[no-untyped-def]
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
        "4",
        "--n-samples-per-prompt",
        "4",
        "--read-block-ms",
        "200",
        "--lr",
        "1e-3",  # the toy model's rate, as tandem up passes it
    ]


def test_trainer_logprobs_match_the_engine_at_step_zero_and_version_one_reaches_the_broker(
    buffer, toy_model_dir: Path
) -> None:
    for group in sample_groups(toy_model_dir, 4, 4):
        buffer.put_group(group)
    sock, endpoint = bind_pull()
    try:
        done = run_trainer([*common_args(toy_model_dir, buffer, endpoint), "--max-steps", "1"])
        assert done.returncode == 0, done.stderr[-3000:]
        version, tensors = receive_version(sock)
    finally:
        sock.close(linger=0)
    records = [r for _, r in buffer.read_metrics() if r.source == "trainer"]
    assert [r.step for r in records] == [1]
    values = records[0].values
    assert values["train/logprob_abs_diff_max"] < 1e-3
    assert values["train/samples"] == 16
    assert math.isfinite(values["train/loss"]) and math.isfinite(values["train/grad_norm"])
    assert buffer.get_version("trainer") == 1
    assert buffer.depth() == 0  # trained groups were acked
    assert "[trainer] step 1" in done.stdout

    from safetensors.torch import load_file

    initial = load_file(toy_model_dir / "model.safetensors")
    assert version == 1
    assert set(tensors) == set(initial)
    assert all(tensors[n].shape == initial[n].shape for n in initial)
    assert any(not torch.equal(tensors[n], initial[n]) for n in initial)


def test_stale_groups_are_recorded_as_drops_and_not_trained_on(buffer, toy_model_dir: Path) -> None:
    stale = sample_groups(toy_model_dir, 1, 4, weight_version=-2, seed=1)
    fresh = sample_groups(toy_model_dir, 4, 4, seed=2)
    for group in stale + fresh:
        buffer.put_group(group)
    done = run_trainer(
        [*common_args(toy_model_dir, buffer), "--max-steps", "1", "--max-staleness", "1"]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert buffer.drop_counts() == {"stale": 1} and buffer.drop_counts("samples") == {"stale": 4}
    assert buffer.ledger().balanced, buffer.ledger().table()
    (record,) = buffer.drop_log()
    assert record.source == "trainer" and record.group_id == "g0" and record.weight_version == -2
    values = next(r.values for _, r in buffer.read_metrics() if r.source == "trainer")
    assert values["train/dropped_stale"] == 4
    assert values["train/samples"] == 16
    assert buffer.depth() == 0


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def start_trainer(buffer, model_dir: Path, ready: Path) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    """`tandem trainer` started, ready once `ready` exists (`wait_ready`)."""
    ready.unlink(missing_ok=True)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "trainer",
            *common_args(model_dir, buffer),
            "--ready-file",
            str(ready),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )


def wait_ready(proc: subprocess.Popen, ready: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), proc.communicate()[1][-3000:]


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP])  # (a closed terminal)
def test_trainer_exits_cleanly_on_sigterm_while_waiting_for_samples(
    buffer, toy_model_dir: Path, tmp_path: Path, number: int
) -> None:
    ready = tmp_path / "ready.json"
    proc = start_trainer(buffer, toy_model_dir, ready)
    try:
        wait_ready(proc, ready)
        proc.send_signal(number)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_one_trainer_per_run_a_second_is_refused_and_one_stopped_past_its_lease_taken_over(
    buffer, toy_model_dir: Path, tmp_path: Path
) -> None:
    """Two trainers on one run trained parts of it with the same version numbers and saved
    into one folder: the second is refused naming the first; one stopped (SIGSTOP) past its
    lease is taken over by the next, and ends (exit 1) when it goes on."""
    first = start_trainer(buffer, toy_model_dir, tmp_path / "first.json")
    third = None
    try:
        wait_ready(first, tmp_path / "first.json")
        argv = [sys.executable, "-m", "tandem.cli", "trainer", *common_args(toy_model_dir, buffer)]
        # (as if the run had trained: the second one is told of the first, not of a lineage)
        buffer.set_version("trainer", 5)
        buffer.redis.hset(buffer.trained_key, "5", "[]")
        second = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)
        buffer.redis.delete(buffer.version_prefix + "trainer", buffer.trained_key)
        assert second.returncode == 2, second.stderr[-3000:]
        run = buffer.config.run_id
        assert f"another trainer holds run {run}: trainer pid {first.pid} on " in second.stderr
        os.killpg(first.pid, signal.SIGSTOP)
        third = start_trainer(buffer, toy_model_dir, tmp_path / "third.json")
        wait_ready(third, tmp_path / "third.json")  # it waited out the stopped one's lease
        os.killpg(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=30)
        assert first.returncode == 1, err[-3000:]
        assert f"another trainer took run {run} over: trainer pid {third.pid} on " in err
        assert third.poll() is None
    finally:
        for proc in (first, third):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                proc.kill()


def test_missing_model_config_and_unreachable_redis_fail_with_the_flag_to_fix(
    tmp_path: Path, toy_model_dir: Path
) -> None:
    done = run_trainer(["--model", str(tmp_path)])
    assert done.returncode != 0
    assert "config.json" in done.stderr and "--model" in done.stderr
    url = "redis://127.0.0.1:1/0"
    done = run_trainer(["--model", str(toy_model_dir), "--redis-url", url])
    assert done.returncode != 0
    assert url in done.stderr and "--redis-url" in done.stderr


@pytest.mark.parametrize("bad", [["--num-steps-per-rollout", "3"]])
def test_batch_arithmetic_that_does_not_divide_is_refused_at_start(
    toy_model_dir: Path, bad: list[str]
) -> None:
    done = run_trainer(
        [
            "--model",
            str(toy_model_dir),
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "4",
            *bad,
        ]
    )
    assert done.returncode != 0
    assert "--num-steps-per-rollout" in done.stderr
