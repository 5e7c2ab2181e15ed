"""Rollout control: start, pause, resume, stop, and validated configuration changes.

Knows: the rollout loop's two asyncio tasks (batches, evaluations) and how to rebuild the
prompt set when the dataset changes. Pause takes effect between batches (the current batch
finishes and is put); stop cancels the tasks at once, and every group still in flight is
recorded as a drop with reason `cancelled`. Start after stop resumes at the unfinished batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import typing
from typing import Any

from services.rollout_router.config import DataConfig
from services.rollout_router.evaluation import run_evaluations
from services.rollout_router.rollout import RolloutLoop

# Fields a running router may change; the model and the run identity may not.
FROZEN = {"model", "rollout", "version_poll_s"}


class ConfigPatchError(ValueError):
    """A PATCH names an unknown or frozen field, has a wrong type, or fails validation."""


def _check_type(name: str, kind: Any, value: Any) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigPatchError(f"{name}: expected a list")
        return [_check_type(f"{name}[]", args[0], v) for v in value]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool):
        raise ConfigPatchError(f"{name}: expected int, got bool")
    if not isinstance(value, kind):
        raise ConfigPatchError(f"{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def patch_dataclass(obj: Any, changes: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(copy of `obj` with the changes that belong to it, the changes left over)."""
    hints = typing.get_type_hints(type(obj))
    mine, rest = {}, {}
    for key, value in changes.items():
        if key in hints and key not in FROZEN:
            mine[key] = _check_type(key, hints[key], value)
        else:
            rest[key] = value
    return dataclasses.replace(obj, **mine), rest


class RolloutController:
    """Owns the rollout loop's tasks; the control routes call one method each."""

    def __init__(self, loop: RolloutLoop, data: DataConfig, tokenizer: Any, build_task: Any):
        self.loop = loop
        self.data = data
        self.tokenizer = tokenizer
        self.build_task = build_task  # (data config, tokenizer) -> Task
        self.task: asyncio.Task | None = None
        self.eval_task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start_evaluations(self) -> None:
        """Evaluations run whether or not rollouts do (agents may be the only producers)."""
        self.eval_task = asyncio.create_task(run_evaluations(self.loop), name="eval")

    def start(self) -> None:
        if self.running:
            return
        self.loop.resume()
        self.task = asyncio.create_task(self.loop.run(), name="rollout")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.loop.state = "stopped"

    async def close(self) -> None:
        await self.stop()
        if self.eval_task is not None:
            self.eval_task.cancel()
            await asyncio.gather(self.eval_task, return_exceptions=True)

    def pause(self) -> None:
        self.loop.pause()

    def resume(self) -> None:
        self.loop.resume()

    async def patch(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply changes to sampling, rollout and data fields; all or nothing."""
        rollout, rest = patch_dataclass(self.loop.config, changes)
        sampling, rest = patch_dataclass(self.loop.sampling, rest)
        data, rest = patch_dataclass(self.data, rest)
        if rest:
            raise ConfigPatchError(f"unknown or read-only fields: {', '.join(sorted(rest))}")
        for part in (rollout, sampling):
            try:
                part.validate()
            except ValueError as exc:
                raise ConfigPatchError(str(exc)) from exc
        if data != self.data:
            try:
                task = await asyncio.to_thread(self.build_task, data, self.tokenizer)
            except ValueError as exc:
                raise ConfigPatchError(str(exc)) from exc
            self.loop.task, self.data = task, data
        self.loop.apply(rollout, sampling)
        return self.config()

    def config(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self.loop.config),
            **dataclasses.asdict(self.loop.sampling),
            **dataclasses.asdict(self.data),
        }
