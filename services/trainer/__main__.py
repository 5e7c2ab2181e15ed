"""`tandem trainer`: command line of the RL trainer (also the torchrun entry point)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from services.common.config_file import parse_args
from services.common.flags import add_config_args, config_from_args
from services.common.paths import unwritable
from services.common.serving import ServiceError, run_service
from services.trainer.config import TrainerConfig

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem trainer", description=DESCRIPTION)
    add_config_args(parser, TrainerConfig)
    parser.add_argument(
        "--ready-file",
        default="",
        help="Write {pid, version, metrics_url} as JSON here once training starts.",
    )
    return parser


def check_model(cfg: TrainerConfig) -> None:
    """Refuse an unsupported `--model` (or one whose sliding window the samples may exceed)
    before importing torch."""
    from proto.models import (
        MOE_MODEL_TYPES,
        check_model_config,
        check_sliding_window,
        read_config,
    )
    from services.common.tokenizers import vocabulary_problem

    hf_cfg, path = read_config(cfg.model)
    if check_model_config(hf_cfg, path) in MOE_MODEL_TYPES and cfg.tensor_model_parallel_size > 1:
        raise ValueError(
            f"{path}: an MoE model trains at --tensor-model-parallel-size 1 (megatron-core's MoE "
            "layer needs sequence parallelism under TP, which the trainer does not use); split "
            "the experts with --expert-model-parallel-size instead"
        )
    context = int(hf_cfg.get("max_position_embeddings", 4096))
    if cfg.use_dynamic_batch_size:  # a sample longer than a micro-batch is refused anyway
        context = min(context, cfg.max_tokens_per_gpu)
    check_sliding_window(hf_cfg, path, context, "--max-tokens-per-gpu (dynamic batch size)")
    if cfg.ref_load and (problem := vocabulary_problem(cfg.model, cfg.ref_load, "--ref-load")):
        raise ValueError(problem)


def check_lineage(cfg: TrainerConfig) -> None:
    """Refuse a start without checkpoint on a run that already trained (see `lineage.py`), or
    while another trainer holds the run (`lease.py`), before importing torch."""
    from services.sample_buffer import BufferConfig, SampleBuffer
    from services.trainer.checkpoint import resolve_iteration
    from services.trainer.lease import TrainerLease

    if cfg.load:  # a bad --load is named before Redis is asked anything
        resolve_iteration(cfg.load, cfg.ckpt_step)
    buffer = SampleBuffer(BufferConfig(redis_url=cfg.redis_url, run_id=cfg.run_id))
    buffer.wait_ready(timeout_s=10.0)
    TrainerLease(buffer).wait_free()  # a second trainer: named as such, not as a lineage
    check_start(cfg, buffer)


def check_start(cfg: TrainerConfig, buffer: Any) -> int:
    """What this start would refuse once its model is built: a lineage refusal (`lineage.py`),
    the checkpoint it resumes from cut short (`checkpoint.check_files`). tandem up runs it
    before the engines start (they take minutes to load a real model). Returns the version a
    new lineage starts at (0: none, or on from the checkpoint)."""
    from services.trainer.lineage import finds_checkpoint, lineage_start

    resumed = finds_checkpoint(cfg)
    version = lineage_start(cfg, buffer, resumed)
    if resumed:
        from services.trainer.checkpoint import check_files, resolve_iteration

        check_files(resolve_iteration(cfg.load or cfg.save, cfg.ckpt_step))
    return version


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), list(sys.argv[1:] if argv is None else argv), "trainer")
    cfg = config_from_args(TrainerConfig, args)
    return run_service(
        "trainer",
        lambda: start(cfg),
        lambda trainer, _sock: run(trainer, args),
        ready_file=args.ready_file,
    )


def start(cfg: TrainerConfig) -> Any:
    """The trainer with its model loaded and the run contract agreed (a mismatch: exit 2)."""
    cfg.validate()
    check_devices()
    check_model(cfg)
    # (the first save may come hours in; --save-hf writes beside its folder, then renames)
    hf_parent = str(Path(cfg.save_hf).parent) if cfg.save_hf else ""
    for path, flag in ((cfg.save, "--save"), (hf_parent, f"--save-hf {cfg.save_hf}: its folder")):
        if path and (problem := unwritable(path, flag)):
            raise ValueError(problem)
    check_lineage(cfg)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.num_threads))
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


def run(trainer: Any, args: argparse.Namespace) -> None:
    from services.sample_buffer import tune_gc_for_reads
    from services.trainer.batching import BatchError
    from services.trainer.checkpoint import SaveError
    from services.trainer.redis_wait import RedisUnavailableError
    from services.trainer.rollout import DeadLettersError

    trainer.install_signal_handlers()
    tune_gc_for_reads()  # the model is built: what the process holds now lives all run
    if args.ready_file:
        ready = {"pid": os.getpid(), "version": trainer.version}
        Path(args.ready_file).write_text(json.dumps({**ready, "metrics_url": trainer.observe.url}))
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
