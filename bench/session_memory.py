"""Router memory held by open agent sessions (services/rollout_router/gateway/session_store.py),
against the same turns held as lists and against the bytes the buffer stores for them, measured
in one run.

`--sessions` sessions of `--turns` chat turns each, as an agent makes them: a first prompt of
`--prompt-len` tokens, then each turn's response (`--response-len` tokens, with log-probs) and
`--between-len` tokens of tool output or user message before the next turn's prompt, which is
the whole conversation so far (what the OpenAI-compatible route renders from the messages). Token
ids are drawn from a 150k vocabulary. Each turn goes through `SessionStore.record` with the
engine's output as the router parses it; the memory held (tracemalloc, after the turn's
transient objects are gone) is measured for:
- ours: the sessions as the router holds them now (arrays; a turn that extends the context
  keeps only the tokens beyond it);
- lists: each turn's whole prompt and its response as Python lists (how the router held them
  before: a `Partial` and the prompt list per turn);
- the limit: the packed entry the buffer stores for each session's samples once it is closed
  (`encode_entry`: ids and log-probs at 4 bytes a token, each token once).

    python bench/session_memory.py
Last line: `session_memory_vs_stored: X` (ours over the limit; lower is better).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto import SampleGroup
from proto.packed import encode_entry, pack
from services.rollout_router.config import SessionConfig
from services.rollout_router.gateway.session_store import SessionStore, session_samples
from services.rollout_router.samples import Partial


def engine_output(rng: np.random.Generator, n: int, version: int) -> dict[str, Any]:
    """One /generate answer as the router parses it (orjson: lists of [log-prob, id, None])."""
    ids, logprobs = rng.integers(0, 150_000, n).tolist(), (-rng.random(n)).tolist()
    return {
        "text": "x" * n,
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "weight_version": str(version),
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
        },
    }


def conversation(args: argparse.Namespace, seed: int) -> list[tuple[list[int], dict[str, Any]]]:
    """One session's turns: (prompt ids, engine output); each prompt a list of its own, as the
    tokenizer renders it afresh at every turn."""
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 150_000, args.prompt_len).tolist()
    turns = []
    for t in range(args.turns):
        out = engine_output(rng, args.response_len, version=t // 4)
        turns.append((np.asarray(context).tolist(), out))
        ids = [pair[1] for pair in out["meta_info"]["output_token_logprobs"]]
        context = context + ids + rng.integers(0, 150_000, args.between_len).tolist()
    return turns


def held_bytes(args: argparse.Namespace, as_lists: bool) -> tuple[int, Any]:
    """Bytes held once every turn of every session is recorded, and what holds them."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = SessionStore(SessionConfig(max_sessions=args.sessions))
    lists: list[list[tuple[list[int], Partial]]] = []
    for s in range(args.sessions):
        turns = conversation(args, s)  # (transient: the engine's answers and the prompts)
        if as_lists:
            lists.append([(prompt, Partial.of(out)) for prompt, out in turns])
        else:
            for prompt, out in turns:
                store.record(f"s{s}", prompt, Partial.of(out))
        del turns
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held, lists if as_lists else store


def stored_bytes(store: SessionStore) -> tuple[int, int]:
    """(bytes of the packed entries of every session's samples, tokens in them)."""
    total = tokens = 0
    for sid, session in list(store.sessions.items()):
        samples = session_samples(session, 1.0)
        tokens += sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        group = SampleGroup(
            group_id=sid, prompt="", label="", samples=samples, weight_version=0, created_at=0.0
        )
        total += len(encode_entry([pack(group)]))
    return total, tokens


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20, help="Open sessions.")
    parser.add_argument("--turns", type=int, default=16, help="Chat turns per session.")
    parser.add_argument("--prompt-len", type=int, default=1024, help="First prompt's tokens.")
    parser.add_argument("--response-len", type=int, default=256, help="Tokens per response.")
    parser.add_argument(
        "--between-len", type=int, default=1024, help="Tool output or user tokens between turns."
    )
    args = parser.parse_args(argv)
    ours, store = held_bytes(args, as_lists=False)
    lists, _ = held_bytes(args, as_lists=True)
    stored, tokens = stored_bytes(store)
    context = args.prompt_len + (args.turns - 1) * (args.response_len + args.between_len)
    context += args.response_len
    print(
        f"sessions: {args.sessions} x {args.turns} turns, final context {context} tokens, "
        f"{tokens} tokens in their samples (each once)"
    )
    print(f"held_bytes_ours: {ours} ({ours / tokens:.1f} B a token)")
    print(f"held_bytes_lists: {lists} ({lists / tokens:.1f} B a token; each turn's whole prompt)")
    print(f"stored_bytes: {stored} ({stored / tokens:.1f} B a token; the buffer's packed entries)")
    print(f"lists_vs_ours: {lists / ours:.1f}")
    print(f"session_memory_vs_stored: {ours / stored:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
