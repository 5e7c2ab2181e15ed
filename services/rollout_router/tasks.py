"""Rollout prompts: the built-in toy task, or JSONL/Parquet datasets, tokenized once.

Knows: where prompts come from and how they become exact input token ids (the model's chat
template for chat-message prompts, or with `--apply-chat-template`).
Does not know: engines, rewards, batching or Redis.

A dataset row has the prompt under `--input-key` (a string, or a list of chat messages
`{"role", "content"}`) and the label under `--label-key` (any JSON value; kept as a string).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.rollout_router.toy_task import is_exact, reverse_digits_split


@dataclass(frozen=True)
class Item:
    """One prompt with its label; `input_ids` are exactly what the engine receives."""

    prompt: str
    label: str
    input_ids: tuple[int, ...]
    messages: tuple[tuple[str, str], ...] = ()


@dataclass
class Task:
    """Train and held-out prompts; `exact` judges eval accuracy (None: reward >= 1)."""

    name: str
    train: list[Item]
    heldout: list[Item]
    exact: Callable[[str, str, bool], bool] | None = None


def encode_prompt(
    tokenizer: Any, prompt: Any, chat: bool, tools: list[dict[str, Any]] | None = None
) -> tuple[int, ...]:
    """Prompt ids as the model sees them. Chat messages (or `chat=True`) go through the
    tokenizer's chat template with the generation prompt (and `tools`, for templates that list
    them); plain text gets the tokenizer's own special tokens (e.g. BOS)."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    return tuple(tokenizer(prompt)["input_ids"])


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a `.jsonl` or `.parquet` file; errors name the file and line."""
    file = Path(path)
    if not file.exists():
        raise ValueError(f"--prompt-data {path}: no such file")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist()
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
    return rows


def load_items(tokenizer: Any, path: str, input_key: str, label_key: str, chat: bool) -> list[Item]:
    items = []
    for number, row in enumerate(read_rows(path), 1):
        if input_key not in row:
            raise ValueError(f"{path}: row {number} has no {input_key!r} (see --input-key)")
        prompt, label = row[input_key], row.get(label_key, "")
        label = label if isinstance(label, str) else json.dumps(label)
        messages = (
            tuple((m["role"], m["content"]) for m in prompt) if isinstance(prompt, list) else ()
        )
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        items.append(Item(text, label, encode_prompt(tokenizer, prompt, chat), messages))
    if not items:
        raise ValueError(f"--prompt-data {path}: no rows")
    return items


def toy_reverse_digits(tokenizer: Any, seed: int) -> Task:
    """The built-in reverse-two-digits task, tokenized once with the model's tokenizer."""
    train, heldout = reverse_digits_split(seed)

    def items(raw: list) -> list[Item]:
        return [Item(t.prompt, t.label, encode_prompt(tokenizer, t.prompt, False)) for t in raw]

    return Task("reverse_digits", items(train), items(heldout), is_exact)


def dataset_task(
    tokenizer: Any, train_path: str, eval_path: str, input_key: str, label_key: str, chat: bool
) -> Task:
    train = load_items(tokenizer, train_path, input_key, label_key, chat)
    heldout = load_items(tokenizer, eval_path, input_key, label_key, chat) if eval_path else []
    return Task(Path(train_path).stem, train, heldout)
