"""A cache of whole prefilled prompts: a prompt seen again skips its prefill.

Keeps, per exact prompt, its keys/values and the logits of its next token, least recently used
first out, within `max_tokens` cached positions. Exact prompts only (no prefix matching): the
hits that matter here are an evaluation prompt sent every step and a group's prompt sent as
separate requests. Owned by the generation thread; the scheduler clears it whenever weights
change and on `/flush_cache`, so nothing is ever served from keys of older weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from services.engine.model_runner import KVCache, ModelRunner, Prefilled, Score, merge_prefilled


class PromptCache:
    """LRU of (logits `[1, vocab]`, one-row `KVCache`) per prompt token tuple."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, KVCache]] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def _get(self, prompt: tuple[int, ...]) -> tuple[torch.Tensor, KVCache] | None:
        entry = self._entries.get(prompt)
        if entry is not None:
            self._entries.move_to_end(prompt)
        return entry

    def _put(self, prompt: tuple[int, ...], logits: torch.Tensor, cache: KVCache) -> None:
        if not self.max_tokens or len(prompt) > self.max_tokens or prompt in self._entries:
            return
        self._entries[prompt] = (logits, cache)
        self._tokens += len(prompt)
        while self._tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self._tokens -= len(old)

    def prefill(
        self,
        runner: ModelRunner,
        prompts: Sequence[Sequence[int]],
        score: Sequence[Score | None],
        cacheable: Sequence[bool],
    ) -> tuple[Prefilled, list[bool]]:
        """`runner.prefill_all`, reusing cached prompts; also returns which rows were hits.
        Rows that need prompt logprobs (`score`) are always computed; `cacheable` rows (plain
        prompts, not retracted sequences) are stored afterwards."""
        keys = [tuple(p) for p in prompts]
        hits = {
            i: e for i, k in enumerate(keys) if score[i] is None and (e := self._get(k)) is not None
        }
        misses = [i for i in range(len(keys)) if i not in hits]
        if not hits:
            result = runner.prefill_all(prompts, score)
            self._store(result, keys, misses, cacheable)
            return result, [False] * len(keys)
        parts: list[Prefilled] = [(logits, cache, [None]) for logits, cache in hits.values()]
        if misses:
            fresh = runner.prefill_all([prompts[i] for i in misses], [score[i] for i in misses])
            self._store(fresh, keys, misses, cacheable)
            parts.insert(0, fresh)
        merged = merge_prefilled(parts, misses + list(hits), runner.device)
        return merged, [i in hits for i in range(len(keys))]

    def _store(
        self,
        result: Prefilled,
        keys: list[tuple[int, ...]],
        rows: list[int],
        cacheable: Sequence[bool],
    ) -> None:
        logits, cache, _ = result
        for j, i in enumerate(rows):
            if cacheable[i] and self.max_tokens:
                self._put(keys[i], logits[j : j + 1].clone(), cache.row(j))
