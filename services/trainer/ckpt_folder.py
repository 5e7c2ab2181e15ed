"""A --save folder's layout, read without building a model: the tracker naming its newest
iteration, each iteration's folder, and whether a checkpoint's files are whole (`check_files`),
so that a start (and `tandem up`, before the engines) refuses a missing or damaged one in a
second. Knows files and torch's checkpoint index (imported when a checkpoint is read: `tandem up`
imports this module with the trainer's config); nothing of the trainer's configuration."""

from __future__ import annotations

import pickle
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"  # names a --save folder's newest checkpoint


def saved_iteration(root: str | Path) -> int | None:
    """The iteration a --save folder's tracker names (None: no tracker there); ValueError when
    the tracker holds no number."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text(errors="replace").strip()
    if not text.isdigit():
        raise ValueError(
            f"{tracker} holds {text[:40]!r}, not an iteration number: not a checkpoint folder "
            "written by --save, or a damaged one (pass --ckpt-step N to pick iter_000000N/)"
        )
    return int(text)


def root_cause(exc: BaseException) -> BaseException:
    """The error itself: torch's CheckpointException holds each failed rank's (error, stack)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        return next(iter(exc.failures.values()))[0]
    return exc


def damaged(path: Path, exc: BaseException, resume: bool = True) -> ValueError:
    """A checkpoint whose files do not load (cut short, damaged): which, why, and the older one
    to go back to (`resume`: as the trainer goes back, a new lineage; else a read of it)."""
    cause = root_cause(exc)
    why = (str(cause).strip().splitlines() or ["a file ends early"])[-1][:200]
    if "shape mismatch" in why:  # whole files of another model's shapes: nothing to go back to
        return ValueError(
            f"checkpoint {path} is not of this model ({type(cause).__name__}: {why}): --model "
            "must have the shapes it was saved with; give that model, or a checkpoint of this one"
        )
    older = sorted(p.name for p in path.parent.glob("iter_*") if p.name < path.name)
    back = int(older[-1].removeprefix("iter_")) if older else None
    if back is None:
        advice = "no older checkpoint is there" + (
            ": start over from --model with --new-lineage" if resume else ""
        )
    elif resume:
        advice = (
            f"go back to iteration {back} with --ckpt-step {back} --new-lineage (tandem up: "
            f"--resume RUN --ckpt-step {back} --new-lineage)"
        )
    else:
        advice = f"the one before it is iteration {back} (--ckpt-step {back})"
    return ValueError(
        f"checkpoint {path} does not load ({type(cause).__name__}: {why}): its files are cut "
        f"short or damaged; {advice}"
    )


def check_files(path: Path, resume: bool = True) -> None:
    """`damaged`'s ValueError when a file of checkpoint `path` is shorter than its index
    (`.metadata`) says or missing (a save cut short, a copy that stopped early): found in a
    second, before a model is built (tandem up: before the engines start)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        items = FileSystemReader(str(path)).read_metadata().storage_data.values()
    except (OSError, EOFError, pickle.UnpicklingError) as exc:
        raise damaged(path, exc, resume) from exc
    needed: dict[str, int] = {}
    for item in items:
        end = item.offset + item.length
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else 0
        if have < size:
            cut = EOFError(f"{name} holds {have} bytes of the {size} its index names")
            raise damaged(path, cut, resume)


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def resolve_iteration(root: str | Path, ckpt_step: int = -1) -> Path:
    """The checkpoint directory to load; errors say what was expected and what is there."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--load {root}: no such directory")
    if ckpt_step < -1:  # (-3 was taken for the latest)
        raise ValueError(f"--ckpt-step {ckpt_step}: at least 0, or -1 (the latest)")
    if ckpt_step < 0:
        saved = saved_iteration(root)
        if saved is None:
            raise FileNotFoundError(
                f"--load {root}: expected {TRACKER} (written by --save) naming the iteration; "
                f"found {sorted(p.name for p in root.iterdir())[:10] or 'nothing'}. "
                "Pass --ckpt-step N to pick iter_000000N/ explicitly."
            )
        ckpt_step = saved
    path = iteration_dir(root, ckpt_step)
    if not (path / "metadata.json").is_file():
        have = sorted(p.name for p in root.glob("iter_*"))
        raise FileNotFoundError(
            f"--load {root}: iteration {ckpt_step} has no checkpoint at {path} "
            f"(available: {have or 'none'})"
        )
    return path
