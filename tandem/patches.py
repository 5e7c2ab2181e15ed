"""The run's `PATCH /rollout/config` changes, for the user of `tandem up`: each said on the
console as it comes, with what a resumed or restarted router re-applied or let a start's own
value override, and copied to RUN_DIR/patches.jsonl.

The run's Redis list (`patches_key`, written only by the router) is the one record: the router
re-applies from it, and the file is its copy, rewritten whole from it. Knows the record's form;
nothing of applying it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from services.rollout_router.config import patches_key
from services.sample_buffer import SampleBuffer

FILE = "patches.jsonl"


class PatchCopy:
    """RUN_DIR/patches.jsonl kept as the run's PATCH record; `update` says what is new."""

    def __init__(self, run_dir: Path, buffer: SampleBuffer, say: Callable[[str], None]):
        """Made at the start of the run's watch: copies and says at once what is new since the
        launch before (what a resumed router re-applied)."""
        self.path, self.say = run_dir / FILE, say
        self.redis, self.key = buffer.redis, patches_key(buffer.config.run_id)
        # (what an earlier launch of the run copied it has said)
        self.said = len(self.path.read_text().splitlines()) if self.path.exists() else 0
        self.update()

    def update(self) -> None:
        """Copy the record to the file and say each record not said yet (nothing while Redis
        does not answer: the next PATCH's mark copies it)."""
        try:
            records = [json.loads(raw) for raw in self.redis.lrange(self.key, 0, -1)]
        except RedisError:
            return
        self.path.write_text("".join(json.dumps(r) + "\n" for r in records))
        for record in records[self.said :]:
            self.say(said(record))
        self.said = len(records)


def said(record: dict[str, Any]) -> str:
    """One record as the console says it."""
    fields = ", ".join(f"{k} = {json.dumps(v)}" for k, v in record["fields"].items())
    at = f"at step {record['version']}"
    by = record.get("by", "PATCH")
    if by == "start":
        return (
            f"the router started {at} with {fields} (this launch's configuration): it wins "
            f"over the run's PATCH of the same field ({FILE})"
        )
    if by.startswith("refused"):
        return f"the router did not re-apply the run's PATCHes {at}: {fields}: {by[9:]}"
    if by == "re-applied":
        return f"the router re-applied the run's PATCHes /rollout/config {at}: {fields} ({FILE})"
    return f"PATCH /rollout/config {at}: {fields} (in {FILE}; a resume re-applies it)"
