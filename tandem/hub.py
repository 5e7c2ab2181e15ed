"""`--model ORG/NAME`: a Hugging Face hub id read from the local Hugging Face cache.

Every service reads the model from a folder. A `--model` that is no folder here but reads as a
hub id (`Qwen/Qwen3-0.6B`) is taken from the copy the Hugging Face cache holds
(`hf download ORG/NAME`, or any earlier `from_pretrained`; `HF_HUB_CACHE` and
`HF_HOME` say where it is), with no network access; when the cache lacks it, the problem names
the command that downloads it. Nothing is downloaded here: a model is gigabytes, and a run's
start is no place to fetch them unannounced.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from services.common.hf_weights import weight_files
from services.common.tokenizers import tokenizer_problem

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
WEIGHTS = ("*.safetensors", "*.bin")


def hub_model(model: str) -> tuple[str, str]:
    """(`model` as a folder: the cache's copy of a hub id, said on stderr, else as given;
    the cache's problem or "")."""
    if not HUB_ID.fullmatch(model) or Path(model).exists():
        return model, model_problem(model)
    folder, problem = from_cache(model)
    if folder:
        print(f"[up] --model {model}: the Hugging Face cache's copy, {folder}", file=sys.stderr)
    return folder or model, problem or model_problem(folder)


def model_problem(model: str) -> str:
    """Why model folder `model` cannot be read whole: its weights' index lists files it lacks
    (a download cut short; found by the trainer only once the engines were up), or it has no
    tokenizer files (the services would find that only as they start). "" when it can, or when
    it is no folder (tandem up says that itself)."""
    if not model or not Path(model).is_dir():
        return ""
    try:
        weight_files(model)
    except ValueError as exc:
        return f"--model {model}: {exc}"
    return tokenizer_problem(model)


def from_cache(model: str) -> tuple[str, str]:
    """(the cached snapshot folder of hub id `model`, "") or ("", the problem, naming the fix)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    download = f"hf download {model}"
    try:
        folder = Path(snapshot_download(model, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError) as exc:
        return "", (
            f"--model {model}: no such folder, and the Hugging Face cache holds no copy of "
            f"it ({type(exc).__name__}); download it first ({download}) and give the same "
            "--model, or give its folder"
        )
    if not (folder / "config.json").is_file() or not any(
        next(folder.glob(pattern), None) for pattern in WEIGHTS
    ):
        return "", (
            f"--model {model}: the Hugging Face cache's copy ({folder}) lacks config.json or "
            f"its weights (*.safetensors, *.bin): download the whole model ({download})"
        )
    return str(folder), ""
