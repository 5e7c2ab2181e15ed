"""The rollout's live settings: the one holder of the rollout and sampling settings in force.

`PATCH /rollout/config` (control.py) replaces them, all or nothing, with validated copies; the
loop, its requests (generation.py) and the evaluations read them here at each use, so a change
reaches the next group and the next request. Knows nothing of who reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proto.run_terms import RunTerms
from services.rollout_router.config import RolloutConfig, SamplingConfig


@dataclass
class LiveSettings:
    """The rollout and sampling settings in force (each replaced whole, never edited), beside
    the run's terms, which no PATCH changes."""

    run: RunTerms
    rollout: RolloutConfig
    sampling: SamplingConfig

    def as_dict(self) -> dict[str, Any]:
        terms = self.run.model_dump(exclude={"run_id", "redis_url", "weight_transport"})
        return {**terms, **self.rollout.model_dump(), **self.sampling.model_dump()}
