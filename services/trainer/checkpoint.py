"""Trainer checkpoints: megatron `dist_checkpointing`, resumable exactly, reshardable across TP.

Layout under `--save DIR`:
  DIR/iter_0000012/          one `dist_checkpointing` directory per saved step (= weight version)
      (sharded)  model, optimizer (Adam moments keyed by the model's global tensor names)
      (common)   scheduler, version, trained_entry_ids, hf_config (the model's config.json, so
                 `tandem convert` can write HF weights back without the original directory)
      rng_rank{r}.pt         torch / python / numpy (/ cuda) RNG state of each rank
  DIR/latest_checkpointed_iteration.txt   the newest complete iteration; written last, so a save
                                         cut short is never the one `--load` picks.

Buffer position: with `--save`, the trainer acks a rollout's groups only after a checkpoint
that contains their update is written (`trained_entry_ids`). A crash before the save leaves
them pending and they are trained again from the older weights; a crash between the save and
the ack leaves them pending too, and `load` returns their ids so the trainer acks them
without training. So no group is lost or trained twice. The cost: up to `save_interval`
rollouts of groups stay in the stream, which must fit the buffer's `max_groups`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from services.trainer.config import TrainerConfig

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def resolve_iteration(root: str | Path, ckpt_step: int = -1) -> Path:
    """The checkpoint directory to load; errors say what was expected and what is there."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--load {root}: no such directory")
    if ckpt_step < 0:
        tracker = root / TRACKER
        if not tracker.is_file():
            raise FileNotFoundError(
                f"--load {root}: expected {TRACKER} (written by --save) naming the iteration; "
                f"found {sorted(p.name for p in root.iterdir())[:10] or 'nothing'}. "
                "Pass --ckpt-step N to pick iter_000000N/ explicitly."
            )
        ckpt_step = int(tracker.read_text().strip())
    path = iteration_dir(root, ckpt_step)
    if not (path / "metadata.json").is_file():
        have = sorted(p.name for p in root.glob("iter_*"))
        raise FileNotFoundError(
            f"--load {root}: iteration {ckpt_step} has no checkpoint at {path} "
            f"(available: {have or 'none'})"
        )
    return path


class Checkpointer:
    """Saves every `save_interval` steps (and at exit) and resumes from `load`."""

    def __init__(self, cfg: TrainerConfig, policy: Any, critic: Any = None) -> None:
        self.cfg = cfg
        self.policy = policy
        self.critic = critic  # a value-head Policy (PPO with GAE), saved beside the policy
        self.last_saved = -1

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.save)

    def due(self, version: int, final: bool) -> bool:
        if not self.enabled or version == self.last_saved:
            return False
        return final or bool(self.cfg.save_interval and version % self.cfg.save_interval == 0)

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

    def save(self, version: int, trained_entry_ids: list[str]) -> Path:
        from megatron.core import dist_checkpointing

        path = iteration_dir(self.cfg.save, version)
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
            padded_vocab_size=self.policy.model.vocab_size,
            expert_model_parallel_size=self.cfg.expert_model_parallel_size,
            has_optimizer=True,
        )
        dist_checkpointing.save(state, str(path))
        torch.save(_rng_state(), path / f"rng_rank{dist.get_rank()}.pt")
        dist.barrier()
        if dist.get_rank() == 0:
            tmp = Path(self.cfg.save) / (TRACKER + ".tmp")
            tmp.write_text(str(version))
            tmp.replace(Path(self.cfg.save) / TRACKER)
        self.last_saved = version
        return path

    def load(self) -> tuple[int, list[str]]:
        """Restore model, optimizer, scheduler and RNG; returns (version, trained_entry_ids)."""
        from megatron.core import dist_checkpointing

        path = resolve_iteration(self.cfg.load, self.cfg.ckpt_step)
        common = dist_checkpointing.load_common_state_dict(str(path))
        full = bool(common.get("has_optimizer"))  # False: weights only (`tandem convert`)
        saved_ep = int(common.get("expert_model_parallel_size", 1))
        if (
            full
            and self.policy.arch.num_experts
            and saved_ep != self.cfg.expert_model_parallel_size
        ):
            # megatron keeps MoE experts in an optimizer of their own only at EP > 1: the
            # optimizer state's layout differs between EP 1 and EP > 1
            raise ValueError(
                f"{path} was saved at --expert-model-parallel-size {saved_ep}: resume at the "
                "same size (the optimizer state of MoE experts does not reshard across EP sizes)"
            )
        loaded = dist_checkpointing.load(self._sharded_state(True, with_optimizer=full), str(path))
        self.policy.model.load_state_dict(loaded["model"])
        if not full:
            return int(loaded.get("version", 0)), []
        self.policy.optimizer.load_state_dict(loaded["optimizer"])
        self.policy.scheduler.load_state_dict(loaded["scheduler"])
        if self.critic is not None:
            self.critic.model.load_state_dict(_strip(loaded["critic_model"], "critic."))
            self.critic.optimizer.load_state_dict(loaded["critic_optimizer"])
            self.critic.scheduler.load_state_dict(loaded["critic_scheduler"])
        rng_file = path / f"rng_rank{dist.get_rank()}.pt"
        if rng_file.is_file():  # absent when resuming on more ranks than saved
            _set_rng_state(torch.load(rng_file, weights_only=False))
        self.last_saved = int(loaded["version"])
        return int(loaded["version"]), list(loaded.get("trained_entry_ids", []))


def _strip(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
