"""The command line of each service `tandem up` starts (engines, broker, router, trainer) from
its configuration, and where they put what they share (the trained model's folder, one-host
weight slots)."""

from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.up_settings import UpConfig


TRAINED_MODEL = "trained_model"  # the Hugging Face model the run trained, in its folder


def gpu_env(gpus: list[int]) -> dict[str, str] | None:
    """CUDA_VISIBLE_DEVICES for a child given GPU indices (None: inherit)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else None


def trains_in_bf16(config: UpConfig) -> bool:
    """A --model trained on a GPU trains in bf16 (with fp32 master weights), as its engines on
    GPUs serve it (their dtype auto); `--trainer-args --no-bf16` keeps fp32. The toy model
    trains in fp32 anywhere."""
    if not config.model or "--no-bf16" in shlex.split(config.trainer_args):
        return False
    if config.config:  # a [trainer] table that says (a run recorded before this default) rules
        from services.common.config_file import ConfigError, read_file

        with contextlib.suppress(ConfigError):
            if "bf16" in read_file(config.config).get("trainer", {}):
                return False
    return trainer_on_gpu(config)


def trainer_on_gpu(config: UpConfig) -> bool:
    """Whether the trainer will see a CUDA device (it uses one whenever it can)."""
    if config.trainer_gpus:
        return True
    import torch

    return torch.cuda.is_available()


def shared_gpus(config: UpConfig) -> list[int]:
    """GPUs that engines and trainer share (the one-GPU layout)."""
    return sorted(set(config.engine_gpus) & set(config.trainer_gpus))


def _given(flag: str, value: object) -> list[str]:
    """`[flag, value]` when the value is set: a flag tandem up leaves to the service's own
    default (or its config table) otherwise."""
    return [flag, str(value)] if value else []


def service_args(
    config: UpConfig,
    run_id: str,
    model: Path,
    redis_url: str,
    run_dir: Path = Path("run"),
    passthrough: bool = True,
) -> dict[str, list[str]]:
    """Command lines of the services (without engine/broker addresses, known only later);
    `passthrough=False`: without the --*-args strings."""
    extra = {
        name: shlex.split(value) if passthrough else []
        for name, value in (
            ("engine", config.engine_args),
            ("router", config.router_args),
            ("trainer", config.trainer_args),
        )
    }
    common = ["--redis-url", redis_url, "--run-id", run_id]
    batch = _flags(
        ("--rollout-batch-size", config.rollout_batch_size),
        ("--n-samples-per-prompt", config.n_samples_per_prompt),
        ("--num-steps-per-rollout", config.num_steps_per_rollout),
        ("--max-staleness", config.max_staleness),
    )
    shm = ["--weights-shm-dir", shm_dir()] if config.weight_transport == "zmq" else []
    return {
        "engine": [
            "engine",
            *_flags(("--model", model), ("--host", "127.0.0.1"), ("--port", 0)),
            *_flags(("--device", config.engine_device)),
            *extra["engine"],
        ],
        "broker": ["broker", "--port", "0", "--transport", config.weight_transport, *common],
        "router": [
            "router",
            *_flags(("--model", model), ("--port", 0), ("--seed", config.seed)),
            *common,
            *batch,
            *_given("--prompt-data", config.prompt_data),
            *_given("--eval-prompt-data", config.eval_prompt_data),
            *_given("--input-key", config.input_key),
            *_given("--label-key", config.label_key),
            *_given("--rm-type", config.rm_type),
            *_given("--custom-rm-path", config.custom_rm_path),
            *_given("--env-url", config.env_url),
            *_given("--rollout-max-response-len", config.rollout_max_response_len),
            *extra["router"],
        ],
        "trainer": [
            "trainer",
            *_flags(("--model", model), ("--seed", config.seed), ("--lr", config.by_model("lr"))),
            *_flags(("--weight-transport", config.weight_transport)),
            *shm,
            *_flags(("--max-steps", config.max_steps)),
            *_flags(("--save", config.save or run_dir / "checkpoints")),
            *_flags(("--save-interval", config.save_interval)),
            *_flags(("--keep-last-checkpoints", config.keep_checkpoints)),
            *_flags(("--save-hf", run_dir / TRAINED_MODEL)),
            *_flags(("--metrics-port", 0)),  # a free port, printed in the trainer's log
            *(["--bf16"] if trains_in_bf16(config) else []),
            *common,
            *batch,
            *extra["trainer"],
        ],
    }


def _flags(*pairs: tuple[str, object]) -> list[str]:
    """`[flag, value, flag, value, ...]` of (flag, value) pairs, each value as a string."""
    return [part for flag, value in pairs for part in (flag, str(value))]


def shm_dir() -> str:
    """Where one-host weight slots go: /dev/shm (RAM) when there is one, else the temp dir."""
    import tempfile

    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
