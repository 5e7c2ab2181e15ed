"""The last groups the rollout loop put, as text and rewards, for the dashboard.

A bounded ring (`RECENT_GROUPS` groups, each text cut at `TEXT_CHARS`): it only ever holds a
few kilobytes, and reading it never touches Redis. Kept in the router process, so it starts
empty after a restart; the groups themselves are in the sample buffer.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from proto import SampleGroup

RECENT_GROUPS = 16  # a screenful: the dashboard shows the newest first
TEXT_CHARS = 400  # per prompt or response; enough to judge a sample at a glance


def _cut(text: str) -> str:
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + "…"


class RecentGroups:
    """Ring of the newest put groups; `add` is called by the rollout loop after each put."""

    def __init__(self, size: int = RECENT_GROUPS) -> None:
        self.groups: deque[dict[str, Any]] = deque(maxlen=size)

    def add(self, group: SampleGroup) -> None:
        self.groups.append(
            {
                "group_id": group.group_id,
                "weight_version": group.weight_version,
                "time": group.created_at,
                "prompt": _cut(group.prompt),
                "label": _cut(group.label),
                "samples": [
                    {
                        "text": _cut(s.response_text),
                        "reward": s.reward,
                        "finish_reason": s.finish_reason,
                        "tokens": len(s.response_ids),
                        "temperature": s.temperature,
                    }
                    for s in group.samples
                ],
            }
        )

    def newest(self, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` groups, newest first."""
        return list(reversed(self.groups))[:limit]
