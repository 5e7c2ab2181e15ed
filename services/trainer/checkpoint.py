"""Trainer checkpoints: megatron `dist_checkpointing`, resumable exactly, reshardable across TP.

Layout under `--save DIR`:
  DIR/iter_0000012/          one `dist_checkpointing` directory per saved step (= weight version)
      (sharded)  model, optimizer (Adam moments keyed by the model's global tensor names)
      (common)   scheduler, version, trained_entry_ids, hf_config (the model's config.json, so
                 `tandem convert` can write HF weights back without the original directory),
                 hf_source (the --model directory, where `tandem convert` finds the tokenizer),
                 run_id, groups_consumed, groups_dead_lettered, scheduler_config (the --lr...
                 flags it was saved with)
      rng_rank{r}.pt         torch / python / numpy (/ cuda) RNG state of each rank, as plain
                             tensors and numbers (loaded with `weights_only=True`)
  DIR/latest_checkpointed_iteration.txt   the newest complete iteration; written last, so a save
                                         cut short is never the one `--load` picks.

Which checkpoint a start resumes from (`find_resume`): `--load DIR`; else the checkpoint that
`--save DIR` already holds (so a restart with the same flags goes on instead of starting over and
moving the tracker back); `--no-resume` starts from `--model`, but never over the tracker of
another run id. `--keep-last-checkpoints K` removes older `iter_*` after each successful save.

Buffer position: with `--save`, the trainer acks a rollout's groups only after a checkpoint
that contains their update is written (`trained_entry_ids`). A crash before the save leaves
them pending and they are trained again from the older weights; a crash between the save and
the ack leaves them pending too, and `load` returns their ids so the trainer acks them
without training. So no group is lost or trained twice. The cost: up to `save_interval`
rollouts of groups stay in the stream (the router's `--max-buffer-depth` does not count them).

The `groups_consumed` counter (Redis `counters` hash; the router's demand gate reads it) counts
every group the trainer is done with for good: trained, dropped stale, or dead-lettered. Stale
groups are acked with the trained ones, so both follow the contract above; a dead-lettered entry
leaves the stream at once (it is never trained, never read again), so a resume adds the dead
letters written since the checkpoint (the `groups_dead_lettered` counter, never set back, minus
its value at save) to the checkpoint's count. A checkpoint stores the
counter's value at save, and a resume of the same run id SETs the counter back to it: the
groups consumed after that checkpoint are pending again, and will be trained (or dropped) and
counted again. A checkpoint of another run id leaves the counter as it is. The drops and
trained groups counted after the checkpoint are taken back with it (`SampleBuffer.rewind_trainer`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import pickle
import queue
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from services.sample_buffer import SampleBuffer
from services.trainer.ckpt_folder import (
    TRACKER,
    damaged,
    iteration_dir,
    resolve_iteration,
    root_cause,
)
from services.trainer.config import SAVED_OPTIMIZER, TrainerConfig
from services.trainer.lineage import rewind_ledger

log = logging.getLogger("tandem.trainer")
NEARLY_FULL = 256 << 20  # free bytes under which a failed save is taken for a full disk


class SaveError(RuntimeError):
    """A checkpoint or Hugging Face model that could not be written (a full disk, a folder
    that is not writable): the trainer stops with this, naming what to fix."""


@contextmanager
def saving(version: int, folders: dict[str, str]) -> Iterator[None]:
    """Turns a failed write of version `version`'s checkpoint or HF model (`folders`: flag ->
    its folder, "" when not written) into a `SaveError`. Nothing is acked before the save ends,
    so the groups of the steps since the last checkpoint stay in the buffer for a resumed run."""
    folders = {flag: folder for flag, folder in folders.items() if folder}
    where = ", ".join(f"{flag} {folder}" for flag, folder in folders.items())
    try:
        yield
    except (Exception, CheckpointException) as exc:  # (torch's is a BaseException)
        cause = root_cause(exc)
        first = (str(cause).strip().splitlines() or [repr(cause)])[0][:300]
        # (torch's zip writer on a full disk says "unexpected pos 704 vs 598", no errno)
        low = nearly_full(list(folders.values()))
        full = getattr(cause, "errno", None) == errno.ENOSPC or "No space left" in str(cause)
        # (a full disk needs no traceback, and the log may be on it: the one line comes first)
        log.error("saving version %d failed", version, exc_info=not (full or low))
        advice = (
            f"the disk is full{f' ({low})' if low else ''}: free space there or point them "
            "at a disk with room"
            if full or low
            else "check that the folders exist and are writable"
        )
        raise SaveError(
            f"could not save version {version} ({where}): {first}; {advice}. The groups "
            "trained since the last checkpoint stay in the buffer, unacknowledged: a resumed "
            "run (--load, or tandem up --resume RUN) trains them again"
        ) from exc


def nearly_full(folders: list[str]) -> str:
    """The first of `folders` whose disk has less than NEARLY_FULL bytes free, as "FOLDER:
    N MiB free" ("" when none has, or none can be looked at)."""
    for folder in folders:
        path = Path(folder).absolute()
        while not path.exists() and path != path.parent:  # (a folder not made yet)
            path = path.parent
        with contextlib.suppress(OSError):
            if (free := shutil.disk_usage(path).free) < NEARLY_FULL:
                return f"{folder}: {free >> 20} MiB free"
    return ""


def find_resume(cfg: TrainerConfig) -> tuple[Path | None, str]:
    """The checkpoint root this start resumes from (None: start from --model), and why."""
    ckpt = cfg.checkpoint
    if ckpt.load:
        resolve_iteration(ckpt.load, ckpt.ckpt_step)  # fail on a bad --load before anything else
        return Path(ckpt.load), "--load"
    if not ckpt.save or not (Path(ckpt.save) / TRACKER).is_file():
        return None, ""
    if ckpt.resume:
        it = resolve_iteration(ckpt.save, ckpt.ckpt_step).name.removeprefix("iter_")
        return Path(ckpt.save), f"(iteration {int(it)}), found by --save; --no-resume starts over"
    common = _common(resolve_iteration(ckpt.save, -1))
    if common.get("run_id") != cfg.run.run_id:
        raise ValueError(
            f"--save {ckpt.save} holds a checkpoint of run id {common.get('run_id')!r} "
            f"(iteration {common.get('version')}); --no-resume would overwrite its tracker from "
            f"run {cfg.run.run_id!r}: pass another --save directory"
        )
    return None, ""


def _common(path: Path) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_common_state_dict(str(path)))


@dataclass
class Resumed:
    """What a loaded checkpoint tells the training loop."""

    version: int
    trained_entry_ids: list[str]
    groups_consumed: int | None  # None: not recorded, or saved by another run id
    path: Path
    groups_dead_lettered: int | None = None  # the run's dead letters at save (None: unknown)


def rewind_to_newest(buffer: SampleBuffer, root: Path, run_id: str) -> None:
    """The run's ledger as of the newest checkpoint under `root` (the groups of the steps after
    it are pending again), as a resume from it would leave it; from its common state only."""
    common = _common(resolve_iteration(root))
    if common.get("run_id") == run_id and common.get("groups_consumed") is not None:
        version, consumed = int(common.get("version", 0)), int(common["groups_consumed"])
        saved = Resumed(version, [], consumed, root, common.get("groups_dead_lettered"))
        rewind_ledger(buffer, saved, version)


class Checkpointer:
    """Saves every `save_interval` steps (and at exit) and resumes from `find_resume`'s root."""

    def __init__(self, cfg: TrainerConfig, policy: Any, critic: Any = None) -> None:
        self.cfg = cfg
        self.policy = policy
        self.critic = critic  # a value-head Policy (PPO with GAE), saved beside the policy
        self.last_saved = -1
        # What the optimizer runs with, which each save records: a resume without
        # --override-opt-param-scheduler keeps its checkpoint's values, not the flags'.
        self.optimizer_used = {k: getattr(cfg.optimizer, k) for k in SAVED_OPTIMIZER}

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.checkpoint.save)

    def due(self, version: int, final: bool) -> bool:
        if not self.enabled or version == self.last_saved:
            return False
        every = self.cfg.checkpoint.save_interval
        return final or bool(every and version % every == 0)

    def _sharded_state(self, is_loading: bool, with_optimizer: bool = True) -> dict[str, Any]:
        model_state = self.policy.model.sharded_state_dict()
        if not with_optimizer:
            return {"model": model_state}
        optimizer = self.policy.optimizer.sharded_state_dict(model_state, is_loading=is_loading)
        state = {"model": model_state, "optimizer": optimizer}
        if self.critic is not None:
            critic_state = self.critic.model.sharded_state_dict(prefix="critic.")
            state["critic_model"] = critic_state
            state["critic_optimizer"] = self.critic.optimizer.sharded_state_dict(
                critic_state, is_loading=is_loading
            )
        return state

    def save(
        self,
        version: int,
        trained_entry_ids: list[str],
        groups_consumed: int,
        groups_dead_lettered: int = 0,
    ) -> Path:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        # Saves are synchronous, so the writer's results come back in this process: a plain
        # queue serves. Megatron's default is a multiprocessing Manager, a spawned server
        # process (~300 MB, and seconds to start) that outlives a trainer killed by SIGKILL.
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = queue.Queue()
        path = iteration_dir(self.cfg.checkpoint.save, version)
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = self._sharded_state(is_loading=False)
        state.update(
            scheduler=self.policy.scheduler.state_dict(),
            **({"critic_scheduler": self.critic.scheduler.state_dict()} if self.critic else {}),
            version=version,
            trained_entry_ids=list(trained_entry_ids),
            hf_config=self.policy.hf_config_json,
            hf_source=str(Path(self.cfg.run.model).resolve()),
            run_id=self.cfg.run.run_id,
            groups_consumed=groups_consumed,
            groups_dead_lettered=groups_dead_lettered,
            scheduler_config=self.optimizer_used,
            padded_vocab_size=self.policy.model.vocab_size,
            expert_model_parallel_size=self.cfg.model.expert_model_parallel_size,
            has_optimizer=True,
        )
        dist_checkpointing.save(state, str(path))
        torch.save(_rng_state(), path / f"rng_rank{dist.get_rank()}.pt")
        dist.barrier()
        if dist.get_rank() == 0:
            tmp = Path(self.cfg.checkpoint.save) / (TRACKER + ".tmp")
            tmp.write_text(str(version))
            tmp.replace(Path(self.cfg.checkpoint.save) / TRACKER)
            self._remove_old(version)
            print(f"[trainer] saved iteration {version} ({self.cfg.checkpoint.save})", flush=True)
        self.last_saved = version
        return path

    def _remove_old(self, newest: int) -> None:
        """--keep-last-checkpoints: drop all but the newest K iterations (never the tracker's)."""
        keep = self.cfg.checkpoint.keep_last_checkpoints
        if keep < 1:
            return
        iters = sorted(
            int(p.name.removeprefix("iter_"))
            for p in Path(self.cfg.checkpoint.save).glob("iter_*")
            if p.name.removeprefix("iter_").isdigit()
        )
        for it in iters[:-keep]:
            if it != newest:
                shutil.rmtree(iteration_dir(self.cfg.checkpoint.save, it), ignore_errors=True)

    def load(self, root: Path) -> Resumed:
        """Restore model, optimizer, scheduler and RNG from the checkpoint under `root`."""
        from megatron.core import dist_checkpointing

        path = resolve_iteration(root, self.cfg.checkpoint.ckpt_step)
        common = _common(path)
        full = bool(common.get("has_optimizer"))  # False: weights only (`tandem convert`)
        saved_ep = int(common.get("expert_model_parallel_size", 1))
        if (
            full
            and self.policy.arch.num_experts
            and saved_ep != self.cfg.model.expert_model_parallel_size
        ):
            # megatron keeps MoE experts in an optimizer of their own only at EP > 1: the
            # optimizer state's layout differs between EP 1 and EP > 1
            raise ValueError(
                f"{path} was saved at --expert-model-parallel-size {saved_ep}: resume at the "
                "same size (the optimizer state of MoE experts does not reshard across EP sizes)"
            )
        try:
            loaded = dist_checkpointing.load(self._sharded_state(True, full), str(path))
        except (CheckpointException, EOFError, pickle.UnpicklingError, OSError) as exc:
            raise damaged(path, exc) from exc
        self.policy.model.load_state_dict(loaded["model"])
        version = int(loaded.get("version", 0))
        if not full:
            return Resumed(version, [], None, path)
        self.policy.optimizer.load_state_dict(loaded["optimizer"])
        self._load_scheduler(self.policy.scheduler, loaded["scheduler"], common)
        if self.critic is not None:
            self.critic.model.load_state_dict(_strip(loaded["critic_model"], "critic."))
            self.critic.optimizer.load_state_dict(loaded["critic_optimizer"])
            self._load_scheduler(self.critic.scheduler, loaded["critic_scheduler"], common)
        rng_file = path / f"rng_rank{dist.get_rank()}.pt"
        if rng_file.is_file():  # absent when resuming on more ranks than saved
            try:
                _set_rng_state(torch.load(rng_file, weights_only=True))
            except pickle.UnpicklingError:  # written before RNG states were plain tensors
                log.warning("%s: RNG state of an older format not restored", rng_file)
        self.last_saved = version
        consumed = common.get("groups_consumed")
        if common.get("run_id") != self.cfg.run.run_id:  # a start from another run's weights
            consumed = None
        return Resumed(
            version,
            list(loaded.get("trained_entry_ids", [])),
            None if consumed is None else int(consumed),
            path,
            common.get("groups_dead_lettered"),
        )

    def _load_scheduler(self, scheduler: Any, state: dict, common: dict[str, Any]) -> None:
        """The checkpoint's optimizer settings (SAVED_OPTIMIZER), or with
        --override-opt-param-scheduler the flags'; a flag that differs from the checkpoint's
        value without it is a warning, never silent (tandem up sets it, saying so)."""
        override, optimizer = self.cfg.checkpoint.override_opt_param_scheduler, self.cfg.optimizer
        scheduler.override_opt_param_scheduler = override
        scheduler.use_checkpoint_opt_param_scheduler = not override
        saved = common.get("scheduler_config") or {}
        differ = [
            f"--{k.replace('_', '-')} {getattr(optimizer, k)} (checkpoint: {saved[k]})"
            for k in SAVED_OPTIMIZER
            if k in saved and saved[k] != getattr(optimizer, k)
        ]
        if not override:
            self.optimizer_used |= {k: v for k, v in saved.items() if k in SAVED_OPTIMIZER}
        if differ and not override and dist.get_rank() == 0:
            print(
                f"[trainer] WARNING: {', '.join(differ)} ignored: the checkpoint's optimizer "
                "settings win on resume; pass --override-opt-param-scheduler to use the flags",
                flush=True,
            )
        if override:  # the loaded optimizer's groups carry the checkpoint's values too
            for group in scheduler.optimizer.param_groups:
                group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
                group["betas"] = (optimizer.adam_beta1, optimizer.adam_beta2)
                group["eps"] = optimizer.adam_eps
        scheduler.load_state_dict(state)


def _strip(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and numbers, so loading it unpickles nothing."""
    py_version, py_state, py_gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python_version": py_version,
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_gauss": py_gauss,
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py_state = tuple(int(x) for x in state["python_state"].tolist())
    random.setstate((state["python_version"], py_state, state["python_gauss"]))
    np.random.set_state(
        (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
