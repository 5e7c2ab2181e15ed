"""The engine's CUDA paths: generation on a GPU and the NCCL weight update.

Skipped without CUDA (NCCL needs two GPUs). These drive the engine's plain classes directly
(`ModelRunner`, `Scheduler`, `WeightUpdater`): the HTTP layer above them is device-agnostic and
covered on CPU. The NCCL test runs exactly the receive path the gloo test runs over HTTP;
only the backend differs, chosen from the device.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[1, 4, 5, 14], [1, 9, 9, 8, 7, 14]]


def run(scheduler, prompts: list[list[int]], **params) -> list:  # type: ignore[no-untyped-def]
    """Submit one job per prompt and wait for every sequence."""
    from services.engine.sampling import SamplingParams, derive_seed
    from services.engine.scheduler import Job, Sequence

    done = threading.Semaphore(0)
    jobs = []
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(**params)
        job = Job(rid=f"r{i}", sequences=[], notify=lambda _job, final: final and done.release())
        job.sequences = [
            Sequence(f"r{i}-{k}", prompt, sp, derive_seed(7, k), job) for k in range(sp.n)
        ]
        jobs.append(job)
    scheduler.submit(jobs)
    for _ in jobs:
        assert done.acquire(timeout=120)
    return [s for job in jobs for s in job.sequences]


def teacher_forced(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0].cpu()


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 0.1)])
def test_cuda_generation_logprobs_match_a_teacher_forced_forward(
    tmp_path: Path, dtype: str, tolerance: float
) -> None:
    from transformers import AutoModelForCausalLM

    from services.engine.model_runner import ModelRunner
    from services.engine.scheduler import Scheduler
    from tandem.toy_model import write_toy_model

    model_dir = write_toy_model(tmp_path / "toy", seed=0)
    runner = ModelRunner(str(model_dir), "", "cuda", dtype)
    scheduler = Scheduler(runner, 256, 4096, 64, 64, "0")
    scheduler.start()
    try:
        seqs = run(scheduler, PROMPTS, max_new_tokens=20, n=4, ignore_eos=True, sampling_seed=3)
    finally:
        scheduler.stop()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).cuda()
    worst = max(
        float(
            (torch.tensor(s.logprobs) - teacher_forced(reference, s.prompt, s.output_ids))
            .abs()
            .max()
        )
        for s in seqs
    )
    print(f"cuda {dtype}: logprob max abs diff vs teacher-forced transformers: {worst:.3e}")
    assert all(len(s.output_ids) == 20 for s in seqs)
    assert worst < tolerance


TRAINER = """
import sys, torch
from datetime import timedelta
import torch.distributed as dist
from services.weight_sync.process_group import join_group
torch.cuda.set_device(0)
port, path = int(sys.argv[1]), sys.argv[2]
group = join_group("127.0.0.1", port, 0, 2, "weight_update_group", "nccl", timedelta(seconds=120))
for name, tensor in torch.load(path):
    dist.broadcast(tensor.cuda(), src=0, group=group)
torch.cuda.synchronize()
print("trainer sent", flush=True)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_nccl_update_receives_broadcasts_into_the_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from proto import sglang as sg
    from services.engine.model_runner import ModelRunner
    from services.engine.scheduler import Scheduler
    from services.engine.weights import WeightUpdater
    from tandem.toy_model import write_toy_model

    torch.cuda.set_device(1)
    model_dir = write_toy_model(tmp_path / "toy", seed=0)
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    new = [(n, t + 0.5) for n, t in old.state_dict().items()]
    torch.save(new, tmp_path / "new.pt")
    with socket.socket() as sock:  # services.common.serving needs uvicorn, absent on GPU images
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    runner = ModelRunner(str(model_dir), "", "cuda", "float32")
    scheduler = Scheduler(runner, 64, 4096, 64, 64, "0")
    scheduler.start()
    updater = WeightUpdater(runner, scheduler, 120)
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(port), str(tmp_path / "new.pt")],
        cwd=Path(__file__).parents[1],
    )
    try:

        async def update() -> str:
            await updater.init_group(
                sg.InitWeightsUpdateGroupReqInput(
                    master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2
                )
            )
            return await updater.from_distributed(
                sg.UpdateWeightsFromDistributedReqInput(
                    names=[n for n, _ in new],
                    dtypes=["float32"] * len(new),
                    shapes=[list(t.shape) for _, t in new],
                    weight_version="5",
                )
            )

        start = time.monotonic()
        version = asyncio.run(update())
        assert trainer.wait(timeout=120) == 0
        print(f"nccl update of {len(new)} tensors took {time.monotonic() - start:.2f}s")
    finally:
        trainer.kill()
        scheduler.stop()
    assert version == "5" and scheduler.weight_version == "5"
    state = runner.model.state_dict()
    for name, tensor in new:
        assert torch.equal(state[name].cpu(), tensor), name
    assert runner.device.type == "cuda"
