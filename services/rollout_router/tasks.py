"""Rollout tasks: prompts (already tokenized), labels, and how a response is scored.

Knows: where prompts come from and how to reward and judge a response text.
Does not know: engines, batching or Redis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.rollout_router.toy_task import is_exact, reverse_digits_reward, reverse_digits_split


@dataclass(frozen=True)
class Item:
    """One prompt with its label; `input_ids` are exactly what the engine receives."""

    prompt: str
    label: str
    input_ids: tuple[int, ...]


RewardFn = Callable[[str, str, bool], float]


@dataclass
class Task:
    """Train and held-out prompts plus the reward and the accuracy criterion."""

    name: str
    train: list[Item]
    heldout: list[Item]
    reward: RewardFn
    exact: Callable[[str, str, bool], bool]


def encode_prompt(tokenizer: Any, prompt: str) -> tuple[int, ...]:
    """Prompt ids as the model sees them (the tokenizer adds BOS if its template says so)."""
    return tuple(tokenizer(prompt)["input_ids"])


def toy_reverse_digits(tokenizer: Any, seed: int) -> Task:
    """The built-in reverse-two-digits task, tokenized once with the model's tokenizer."""
    train, heldout = reverse_digits_split(seed)

    def items(raw: list) -> list[Item]:
        return [Item(t.prompt, t.label, encode_prompt(tokenizer, t.prompt)) for t in raw]

    return Task("reverse_digits", items(train), items(heldout), reverse_digits_reward, is_exact)
