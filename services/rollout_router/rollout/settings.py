"""The rollout's live settings: the one holder of the rollout and sampling settings in force.

`PATCH /rollout/config` (control.py) replaces them, all or nothing, with validated copies; the
loop, its requests (generation.py) and the evaluations read them here at each use, so a change
reaches the next group and the next request. Knows nothing of who reads them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from services.rollout_router.config import RolloutConfig, SamplingConfig


@dataclass
class LiveSettings:
    """The rollout and sampling settings in force (each replaced whole, never edited)."""

    rollout: RolloutConfig
    sampling: SamplingConfig

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.rollout), **dataclasses.asdict(self.sampling)}
