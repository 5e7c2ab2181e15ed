"""Folders a service will write into, checked when it starts rather than at its first write
(a trainer's first checkpoint may come hours into a run)."""

from __future__ import annotations

import tempfile
from pathlib import Path


def unwritable(path: str, flag: str) -> str:
    """Why `path` cannot be a folder this process writes into ("" when it can), naming `flag`.
    The folder is made as the first write would make it, and a file written and removed."""
    try:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tandem-write-check-"):
            pass
    except OSError as exc:
        return f"{flag} {path}: cannot write there ({exc.strerror or exc}); give a folder you can write"
    return ""
