"""`tandem trainer`: command line of the RL trainer (also the torchrun entry point)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from services.common.serving import ServiceError, run_service
from services.common.settings import load
from services.trainer.config import TrainerConfig, check, check_start

PROG = "tandem trainer"

DESCRIPTION = """\
megatron-core RL trainer (GRPO family). Reads sample groups from the Redis sample buffer, drops
(and records) groups more than --max-staleness versions old, trains one or more optimizer steps
per rollout of --rollout-batch-size groups with a clipped policy-gradient loss, and after each
step sends the new weights (Hugging Face names) to the weight broker at --weights-endpoint and
publishes the version and train/* metrics to Redis. Version 0 is the --model weights.
Resume: --load DIR, or a --save DIR that already holds a checkpoint (--no-resume starts over);
the resumed version is sent to the broker before training. --save-hf DIR keeps the trained
model as a Hugging Face directory. A bad entry in the buffer (undecodable, wrong lengths, too
long, non-finite reward, ...) is moved to the run's dead-letter stream, never trained. A start
without a checkpoint on a run that already trained is refused (--new-lineage starts over).
Exit codes: 0 = the run trained as asked; 1 = it failed (e.g. --max-skipped-in-a-row non-finite
updates, Redis gone past --redis-timeout-s); 2 = bad flags, a run-contract mismatch or a
lineage refusal.
Multi-process: torchrun --nproc-per-node N -m services.trainer ... (TP x DP = N)."""


def check_lineage(cfg: TrainerConfig) -> None:
    """Refuse a start without checkpoint on a run that already trained (`config.lineage_start`), or
    while another trainer holds the run (`lease.py`), before importing torch."""
    from services.sample_buffer import BufferConfig, SampleBuffer
    from services.trainer.lease import trainer_membership

    buffer = SampleBuffer(BufferConfig(redis_url=cfg.run.redis_url, run_id=cfg.run.run_id))
    buffer.wait_ready(timeout_s=10.0)
    trainer_membership(buffer).wait_free()  # a second trainer: named as such, not as a lineage
    check_start(cfg, buffer)


def main(argv: list[str] | None = None) -> int:
    cfg = load(
        TrainerConfig, sys.argv[1:] if argv is None else argv, "trainer", PROG, about=DESCRIPTION
    )
    return run_service(
        "trainer",
        lambda: start(cfg),
        lambda trainer, _sock: run(trainer, cfg.ready_file),
        ready_file=cfg.ready_file,
    )


def start(cfg: TrainerConfig) -> Any:
    """The trainer with its model loaded and the run contract agreed (a mismatch: exit 2)."""
    cfg.validate()
    check_devices()
    if problems := check(cfg):
        raise ValueError(problems[0])
    check_lineage(cfg)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.model.num_threads))
    from services.trainer.cpu_compat import import_megatron

    import_megatron()  # (first: on CPU, without compiling its kernels)
    from services.trainer.trainer import Trainer

    return Trainer(cfg)


def check_devices() -> None:
    """GPUs named (CUDA_VISIBLE_DEVICES: tandem up's --trainer-gpus) that torch cannot see are
    a mistake (an index this machine lacks, no driver), not a CPU run: the trainer would
    train on CPU, orders of magnitude slower, and say nothing."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not visible or visible.startswith("-"):  # unset, or GPUs hidden on purpose
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={visible} (tandem up's --trainer-gpus) names GPUs, but torch "
            "sees no CUDA device: give indices of this machine's GPUs (nvidia-smi -L), or none "
            "to train on CPU"
        )


def run(trainer: Any, ready_file: str) -> None:
    from services.sample_buffer import tune_gc_for_reads
    from services.trainer.batching import BatchError
    from services.trainer.checkpoint import SaveError
    from services.trainer.redis_wait import RedisUnavailableError
    from services.trainer.rollout import DeadLettersError

    trainer.install_signal_handlers()
    tune_gc_for_reads()  # the model is built: what the process holds now lives all run
    if ready_file:
        ready = {"pid": os.getpid(), "version": trainer.version}
        Path(ready_file).write_text(json.dumps({**ready, "metrics_url": trainer.observe.url}))
    error = ""
    try:
        steps = trainer.train()
    except (
        FloatingPointError,
        BatchError,
        TimeoutError,
        RedisUnavailableError,
        SaveError,
        DeadLettersError,
    ) as exc:
        # TimeoutError: broker gone; RedisUnavailableError: Redis gone past --redis-timeout-s;
        # SaveError: a checkpoint or HF model not written (a full disk); DeadLettersError:
        # no group fits this trainer
        error = str(exc)
        raise ServiceError(str(exc)) from exc
    finally:
        trainer.close(error)
    print(f"[trainer] stopped after {steps} steps at version {trainer.version}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
