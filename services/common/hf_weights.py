"""The weight files of a Hugging Face model folder, as the engine and the trainer read them."""

from __future__ import annotations

import json
from pathlib import Path

FORMATS = (
    ("model.safetensors.index.json", "*.safetensors"),
    ("pytorch_model.bin.index.json", "*.bin"),
)


def weight_files(folder: str | Path) -> list[Path]:
    """The files of a model's weights: those its index names (a sharded model's `*.index.json`;
    other files beside them, as Mistral's `consolidated.safetensors`, hold the same weights in
    another format, and reading them too doubles the memory), else every `*.safetensors`, else
    every `*.bin` ([] when none); ValueError naming a file the index lists that is not there (a
    download cut short)."""
    path = Path(folder)
    for index, pattern in FORMATS:
        if (path / index).is_file():
            try:
                names = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path / index}: not a weight index ({exc!r})") from None
            if missing := [name for name in names if not (path / name).is_file()]:
                raise ValueError(
                    f"{path / index} lists {len(missing)} weight files that are not in the folder "
                    f"(the first: {missing[0]}): a download cut short? download the model again"
                )
            return [path / name for name in names]
        if files := sorted(path.glob(pattern)):
            return files
    return []
