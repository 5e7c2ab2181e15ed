"""The built-in toy task: reverse two digits (`37>` -> `73` then end-of-sequence).

A task a tiny model learns from scratch by GRPO and that generalises: the held-out prompts are
digit pairs never seen in training, so accuracy on them measures a learned rule, not a lookup.
Reward gives partial credit (one third per correct digit and one for stopping right after them),
which keeps the signal dense enough for a random-init model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskItem:
    prompt: str
    label: str


def reverse_digits_split(
    seed: int = 1234, num_heldout: int = 20
) -> tuple[list[TaskItem], list[TaskItem]]:
    """(train, held-out) items over all 100 digit pairs; the split depends only on `seed`."""
    items = [TaskItem(prompt=f"{a}{b}>", label=f"{b}{a}") for a in range(10) for b in range(10)]
    rng = random.Random(seed)
    rng.shuffle(items)
    return items[num_heldout:], items[:num_heldout]


def reverse_digits_reward(response_text: str, label: str, stopped: bool) -> float:
    """Partial credit: a third for each correct digit, a third for ending right after two chars.

    `stopped` is True when generation ended on the end-of-sequence token (finish_reason "stop").
    """
    score = sum(1.0 for i in range(2) if response_text[i : i + 1] == label[i : i + 1] != "")
    score += 1.0 if stopped and len(response_text) == 2 else 0.0
    return score / 3.0


def is_exact(response_text: str, label: str, stopped: bool) -> bool:
    """The accuracy criterion: exactly the label, then end-of-sequence."""
    return stopped and response_text == label
