"""The command line and per-run values of each service `tandem up` starts (engines, broker,
router, trainer), and where they put what they share (the trained model's folder, one-host
weight slots). Each child reads its resolved section from its file, RUN_DIR/<service>.toml;
what is known only once others are up (their addresses) comes as flags over it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from services.common.settings import leaves
from tandem.up_tree import SERVICES, UpTree

TRAINED_MODEL = "trained_model"  # the Hugging Face model the run trained, in its folder


def gpu_env(gpus: list[int]) -> dict[str, str] | None:
    """CUDA_VISIBLE_DEVICES for a child given GPU indices (None: inherit)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else None


def trains_in_bf16(tree: UpTree) -> bool:
    """A --model trained on a GPU trains in bf16 (with fp32 master weights), as its engines on
    GPUs serve it (their dtype auto), unless the trainer's bf16 is given (--no-bf16 keeps
    fp32). The toy model trains in fp32 anywhere."""
    if not tree.up.run.model or tree.given("trainer", "bf16"):
        return False
    return trainer_on_gpu(tree)


def trainer_on_gpu(tree: UpTree) -> bool:
    """Whether the trainer will see a CUDA device (it uses one whenever it can)."""
    if tree.up.trainer_gpus:
        return True
    import torch

    return torch.cuda.is_available()


def shared_gpus(tree: UpTree) -> list[int]:
    """GPUs that engines and trainer share (the one-GPU layout)."""
    return sorted(set(tree.up.engine_gpus) & set(tree.up.trainer_gpus))


def run_values(
    tree: UpTree, run_id: str, model: Path, redis_url: str, run_dir: Path
) -> dict[str, Any]:
    """What tandem up gives each service per run (where its config has the key and it was not
    given): the run id, Redis, the model used, any free port, where the trainer saves."""
    values: dict[str, Any] = {
        "run_id": run_id,
        "redis_url": redis_url,
        "model": str(model),
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,  # a free port, printed in the trainer's log
        "save": str(run_dir / "checkpoints"),
        "save_hf": str(run_dir / TRAINED_MODEL),
    }
    if tree.up.run.weight_transport == "zmq":
        values["weights_shm_dir"] = shm_dir()
    if trains_in_bf16(tree):
        values["bf16"] = True
    return values


def service_args(files: dict[str, Path], run: dict[str, Any]) -> dict[str, list[str]]:
    """Each service's command line: its subcommand, its file, and where it listens when its
    config has no such setting (a flag of its command alone: any free port on this host)."""
    out = {}
    for name, path in files.items():
        own = leaves(SERVICES[name])
        listen = [] if name == "trainer" else [k for k in ("host", "port") if k not in own]
        out[name] = [name, "--config", str(path)]
        out[name] += [word for k in listen for word in (f"--{k}", str(run[k]))]
    return out


def shm_dir() -> str:
    """Where one-host weight slots go: /dev/shm (RAM) when there is one, else the temp dir."""
    import tempfile

    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
