"""Which lineage of weights a trainer start continues: refuse to mix two silently.

A run's Redis remembers its trainer's published version and the groups each version trained.
A start that finds no checkpoint trains from --model, version 0: on a run that already has
trained versions it would feed on the samples the old weights made and publish versions the
broker already holds as old, and the run would stall without a word. `lineage_start` refuses
that start (ValueError: exit 2, naming the fix) unless --new-lineage: then the new lineage's
versions begin after the published one (its first, --model's weights, is sent at start so the
engines take it), and groups stamped with an older version are dead-lettered as foreign.
Knows nothing of torch, so the CLI refuses before loading it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.sample_buffer import SampleBuffer, recovery
from services.trainer.config import TrainerConfig

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


def finds_checkpoint(cfg: TrainerConfig) -> bool:
    """Whether this start resumes from a checkpoint (as `checkpoint.find_resume` decides)."""
    return bool(cfg.checkpoint.load) or bool(
        cfg.checkpoint.save
        and cfg.checkpoint.resume
        and (Path(cfg.checkpoint.save) / TRACKER).is_file()
    )


def rollback(cfg: TrainerConfig) -> tuple[int, int] | None:
    """(K, L) when this start resumes from checkpoint K (--ckpt-step) of a folder whose newest
    is L > K: the groups steps K+1..L trained were acknowledged at L's save and are gone, so the
    run cannot replay them; None otherwise."""
    root = cfg.checkpoint.load or (cfg.checkpoint.save if cfg.checkpoint.resume else "")
    newest = saved_iteration(root) if root else None
    if cfg.checkpoint.ckpt_step < 0 or newest is None or newest <= cfg.checkpoint.ckpt_step:
        return None
    return cfg.checkpoint.ckpt_step, newest


def lineage_start(cfg: TrainerConfig, buffer: SampleBuffer, resumed: bool) -> int:
    """The version this start begins at: 0 (a fresh run, or a resume that goes on where its
    checkpoint left off), or with --new-lineage the published one + 1. Raises ValueError for a
    start without checkpoint on a trained run, and for a resume of a trained run from a
    checkpoint older than its folder's newest (`rollback`), unless --new-lineage. (A new run
    may start from any checkpoint: nothing of it was acknowledged yet.)"""
    published = buffer.get_version("trainer", 0)
    trained = int(buffer.redis.hlen(buffer.trained_key))
    if resumed and (published > 0 or trained) and (back := rollback(cfg)):  # (on this run)
        if not cfg.checkpoint.new_lineage:
            raise ValueError(
                f"--ckpt-step {back[0]} goes back past this run's newest checkpoint (iteration "
                f"{back[1]} in {cfg.checkpoint.load or cfg.checkpoint.save}): the groups of the steps after "
                f"{back[0]} were acknowledged at that save and are gone, so the run cannot "
                f"train them again. Pass --new-lineage as well to go on from iteration "
                f"{back[0]}'s weights as a new lineage (versions after {max(published, back[1])}"
                "; groups made by the newer weights are dead-lettered), or leave --ckpt-step "
                "out to resume from the newest"
            )
        return max(published, back[1]) + 1
    if resumed or (published <= 0 and not trained):
        return 0
    if not cfg.checkpoint.new_lineage:
        raise ValueError(
            f"run {cfg.run.run_id!r} in Redis ({cfg.run.redis_url}) already has trainer version "
            f"{published} and {trained} trained steps, but no checkpoint was found (--save "
            f"{cfg.checkpoint.save or '(none)'}, --load {cfg.checkpoint.load or '(none)'}): point --save/--load at "
            "this run's checkpoint folder to resume, or use a new --run-id (or an empty Redis), "
            "or pass --new-lineage to start over from --model in this run"
        )
    return published + 1


def begin_lineage(buffer: SampleBuffer, version: int, weights: str = "--model") -> None:
    """--new-lineage: the lineage of the newest weights (`trained`) starts anew at `version`,
    from `weights`."""
    trained = buffer.counters().get("groups_trained", 0)
    pipe = buffer.redis.pipeline(transaction=True)
    pipe.delete(buffer.trained_key)
    pipe.hset(buffer.counters_key, recovery.EARLIER, trained)  # (a later rewind keeps them)
    pipe.execute()
    print(
        f"[trainer] --new-lineage: starting from {weights} as version {version}; groups made "
        f"by older versions are dead-lettered (foreign_lineage)",
        flush=True,
    )


def rewind_ledger(buffer: SampleBuffer, resumed: Any, version: int) -> str:
    """On a resume at `version` from a checkpoint (`resumed`, checkpoint.py) that had consumed
    `resumed.groups_consumed` groups: the groups consumed after its save are pending again, but
    for the dead letters written since. A buffer with no record of the groups `version` trained lost the run's
    data (a new Redis): nothing is rewound, its ledger counts from there; the sentence that
    says so ("" when rewound)."""
    consumed = resumed.groups_consumed
    if version and not buffer.redis.hexists(buffer.trained_key, str(version)):
        return (
            f"the buffer holds no record of the groups version {version} trained (nor of the "
            f"{consumed} this checkpoint consumed): its Redis lost the run's data; its ledger "
            "counts from here, and training goes on from the checkpoint"
        )
    now = buffer.counters().get("groups_dead_lettered", 0)
    saved = resumed.groups_dead_lettered
    since = max(now - (now if saved is None else saved), 0)
    buffer.rewind_trainer(consumed + since, version)
    return ""
