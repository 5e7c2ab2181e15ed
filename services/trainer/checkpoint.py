"""Checkpoints of the trainer (megatron dist_checkpointing). Filled in after milestone 1."""

from __future__ import annotations

from typing import Any

from services.trainer.config import TrainerConfig


class Checkpointer:
    """Saves every `save_interval` steps and resumes from `load`."""

    def __init__(self, cfg: TrainerConfig, policy: Any) -> None:
        self.cfg = cfg
        self.policy = policy

    def maybe_save(self, version: int, final: bool) -> None:
        if self.cfg.save:
            raise NotImplementedError("--save is not implemented yet")

    def load(self) -> int:
        raise NotImplementedError("--load is not implemented yet")
