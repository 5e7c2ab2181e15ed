"""`tandem up`: the whole asynchronous RL loop on one machine, every service its own process.

Start order: Redis (unless --redis-url/REDIS_URL) -> engines -> weight broker -> router ->
trainer. The launcher then only watches: it reads the metrics stream from Redis, prints one line
per trainer step, appends every record to `RUN_DIR/metrics.jsonl`, and stops everything when the
held-out accuracy reaches --stop-accuracy, the trainer finishes --max-steps, --time-limit-s
passes, a child dies, or Ctrl-C. Exit code: 0 when the run reached its goal, 1 otherwise,
130 on Ctrl-C. Services talk only over HTTP, Redis and ZMQ, exactly as in a multi-host setup.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.flags import add_config_args, config_from_args
from tandem.up_args import conflicts, given_fields, join_passthrough, resumed_config


@dataclass
class UpConfig:
    """What `tandem up` runs. Defaults train the built-in toy task to >= 90% in minutes."""

    run_dir: str = field(
        default="", metadata={"help": "Run folder (default: runs/<time>-seed<S>)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed for the model init, data and sampling."})
    model: str = field(
        default="", metadata={"help": "HF model directory (default: the toy model, made fresh)."}
    )
    num_engines: int = field(default=2, metadata={"help": "Reference engines to start."})
    redis_url: str = field(
        default_factory=lambda: os.environ.get("REDIS_URL", ""),
        metadata={"help": "Use this Redis instead of starting one (env REDIS_URL)."},
    )
    max_steps: int = field(default=300, metadata={"help": "Trainer steps at most."})
    stop_accuracy: float = field(
        default=0.9,
        metadata={"help": "Stop once held-out greedy accuracy reaches this (0 = never)."},
    )
    time_limit_s: float = field(default=900.0, metadata={"help": "Wall-clock limit of the run."})
    startup_timeout_s: float = field(
        default=180.0, metadata={"help": "Longest any service may take to start."}
    )
    resume: str = field(
        default="",
        metadata={
            "help": "Resume the run in this run folder: the same services, configuration, Redis "
            "data and the trainer's last checkpoint; flags given beside it override the saved "
            "ones (the run contract's batch terms cannot change)."
        },
    )
    save_interval: int = field(
        default=10,
        metadata={
            "help": "Checkpoint every this many steps into RUN_DIR/checkpoints (0 = only at the "
            "end); the trained model is written to RUN_DIR/trained_model at each save."
        },
    )
    stall_warn_s: float = field(
        default=60.0,
        metadata={"help": "Print what each service waits for when no step completed this long."},
    )
    stall_fail_s: float = field(
        default=600.0,
        metadata={
            "help": "End the run (exit 1, with the diagnosis) after this long without a step."
        },
    )
    rollout_batch_size: int = field(default=64, metadata={"help": "Prompts per rollout batch."})
    n_samples_per_prompt: int = field(default=8, metadata={"help": "Samples per prompt (group)."})
    num_steps_per_rollout: int = field(
        default=1, metadata={"help": "Optimizer steps per rollout batch."}
    )
    lr: float = field(default=1e-3, metadata={"help": "Trainer learning rate."})
    max_staleness: int = field(
        default=1, metadata={"help": "Versions a sample may lag the trainer before it is dropped."}
    )
    weight_transport: str = field(
        default="zmq",
        metadata={
            "help": "Trainer -> engines weight path: zmq (via the broker) or nccl (broadcast "
            "into the engines' weight group; gloo on CPU).",
            "choices": ["zmq", "nccl"],
        },
    )
    engine_device: str = field(
        default="cpu",
        metadata={"help": "Device of the engines.", "choices": ["cpu", "cuda"]},
    )
    engine_gpus: list[int] = field(
        default_factory=list,
        metadata={"help": "GPU index of each engine (CUDA_VISIBLE_DEVICES), one per engine."},
    )
    trainer_gpus: list[int] = field(
        default_factory=list,
        metadata={"help": "GPUs of the trainer (CUDA_VISIBLE_DEVICES); empty = as inherited."},
    )
    trainer_procs: int = field(
        default=1,
        metadata={"help": "Trainer processes (torchrun); = tensor-parallel x data-parallel size."},
    )
    engine_args: str = field(
        default="", metadata={"help": "Extra flags for `tandem engine`, one quoted string."}
    )
    trainer_args: str = field(
        default="", metadata={"help": "Extra flags for `tandem trainer`, one quoted string."}
    )
    router_args: str = field(
        default="", metadata={"help": "Extra flags for `tandem router`, one quoted string."}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem up",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(parser, UpConfig)
    argv = join_passthrough(list(sys.argv[1:] if argv is None else argv))
    config = config_from_args(UpConfig, parser.parse_args(argv))
    problems: list[str] = []
    if config.resume:
        config, problems = resumed_config(config, given_fields(parser, argv))
    problems += validate(config)
    if problems:
        for problem in problems:
            print(f"tandem up: {problem}", file=sys.stderr)
        return 2
    from tandem.up_run import UpRun

    return UpRun(config).run()


def validate(config: UpConfig) -> list[str]:
    problems = []
    if config.num_engines < 1:
        problems.append("--num-engines must be at least 1")
    if config.model and not (Path(config.model) / "config.json").exists():
        problems.append(f"--model {config.model}: no config.json there (expected a HF directory)")
    if not 0 <= config.stop_accuracy <= 1:
        problems.append("--stop-accuracy must be within [0, 1]")
    if config.max_steps < 1:
        problems.append("--max-steps must be at least 1")
    own = service_args(config, "run", Path(config.model or "model"), "redis://")
    passthrough = {
        "engine": config.engine_args,
        "router": config.router_args,
        "trainer": config.trainer_args,
    }
    problems += conflicts(
        {
            name: own[name][: len(own[name]) - len(shlex.split(passthrough[name]))]
            for name in passthrough
        },
        passthrough,
    )
    if config.engine_gpus and len(config.engine_gpus) != config.num_engines:
        problems.append(
            f"--engine-gpus names {len(config.engine_gpus)} GPUs for {config.num_engines} "
            "engines (--num-engines): give one per engine"
        )
    if config.engine_device == "cuda" and not config.engine_gpus:
        problems.append("--engine-device cuda needs --engine-gpus (one GPU index per engine)")
    if config.trainer_gpus and len(config.trainer_gpus) < config.trainer_procs:
        problems.append(
            f"--trainer-procs {config.trainer_procs} needs as many --trainer-gpus "
            f"(got {len(config.trainer_gpus)})"
        )
    overlap = set(config.engine_gpus) & set(config.trainer_gpus)
    if overlap:
        problems.append(f"GPUs {sorted(overlap)} are given to both the engines and the trainer")
    if (
        config.weight_transport == "nccl"
        and config.engine_device == "cpu"
        and trainer_on_gpu(config)
    ):
        problems.append(
            "--weight-transport nccl with engines on CPU, but the trainer runs on a GPU: NCCL "
            "needs both ends on GPUs (--engine-device cuda --engine-gpus ...), or use "
            "--weight-transport zmq"
        )
    return problems


TRAINED_MODEL = "trained_model"  # the Hugging Face model the run trained, in its folder


def trainer_on_gpu(config: UpConfig) -> bool:
    """Whether the trainer will see a CUDA device (it uses one whenever it can)."""
    if config.trainer_gpus:
        return True
    import torch

    return torch.cuda.is_available()


def service_args(
    config: UpConfig, run_id: str, model: Path, redis_url: str, run_dir: Path = Path("run")
) -> dict[str, list[str]]:
    """Command lines of the services (without engine/broker addresses, known only later)."""
    common = ["--redis-url", redis_url, "--run-id", run_id]
    batch = [
        "--rollout-batch-size",
        str(config.rollout_batch_size),
        "--n-samples-per-prompt",
        str(config.n_samples_per_prompt),
        "--num-steps-per-rollout",
        str(config.num_steps_per_rollout),
        "--max-staleness",
        str(config.max_staleness),
    ]
    return {
        "engine": [
            "engine",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device",
            config.engine_device,
            *shlex.split(config.engine_args),
        ],
        "broker": ["broker", "--port", "0", "--transport", config.weight_transport, *common],
        "router": [
            "router",
            "--model",
            str(model),
            "--port",
            "0",
            "--seed",
            str(config.seed),
            *common,
            *batch,
            *shlex.split(config.router_args),
        ],
        "trainer": [
            "trainer",
            "--model",
            str(model),
            "--seed",
            str(config.seed),
            "--lr",
            str(config.lr),
            "--weight-transport",
            config.weight_transport,
            *(["--weights-shm-dir", shm_dir()] if config.weight_transport == "zmq" else []),
            "--max-steps",
            str(config.max_steps),
            "--save",
            str(run_dir / "checkpoints"),
            "--save-interval",
            str(config.save_interval),
            "--save-hf",
            str(run_dir / TRAINED_MODEL),
            *common,
            *batch,
            *shlex.split(config.trainer_args),
        ],
    }


def shm_dir() -> str:
    """Where one-host weight slots go: /dev/shm (RAM) when there is one, else the temp dir."""
    import tempfile

    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def default_run_dir(seed: int) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-seed{seed}"


def write_summary(run_dir: Path, summary: dict) -> None:
    def clean(value: object) -> object:
        return None if isinstance(value, float) and math.isnan(value) else value

    (run_dir / "summary.json").write_text(
        json.dumps({k: clean(v) for k, v in summary.items()}, indent=2)
    )


def install_interrupt_handler(flag: list[bool]) -> None:
    """Ctrl-C / SIGTERM set a flag the monitor loop checks (children are stopped there)."""

    def handler(signum: int, _frame: object) -> None:
        flag.append(True)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    sys.exit(main())
