"""Rollout prompts: the built-in toy task, or JSONL/Parquet datasets, tokenized once.

Knows: where prompts come from; they become exact input token ids through
`gateway/chat_input.py` `encode_prompt` (the model's chat template for chat-message prompts, or
with `--apply-chat-template`).
Does not know: engines, rewards, batching or Redis.

A dataset row has the prompt under `--input-key` (a string, or a list of chat messages
`{"role", "content"}`) and the label under `--label-key` (any JSON value; kept as a string).
A row without a label (absent, null or "") is left out when other rows have one, with a note
naming how many and the first (a reward would compare its responses with an empty label).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import random
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from services.common.chat_messages import MessageError
from services.rollout_router.gateway.chat_input import encode_prompt
from services.rollout_router.rollout.toy_task import is_exact, reverse_digits_split

BOM = b"\xef\xbb\xbf"  # (a UTF-8 byte-order mark, as Windows tools write)
T = TypeVar("T")
log = logging.getLogger("tandem.router.data")
PROGRESS_S = 10.0  # a dataset read longer than this says how far it is (tandem up shows it)


@dataclass(frozen=True)
class Item:
    """One prompt with its label; `input_ids` are exactly what the engine receives."""

    prompt: str
    label: str
    input_ids: tuple[int, ...]
    messages: tuple[tuple[str, str], ...] = ()


# max_new_tokens of a dataset's (or an environment's) responses when none is configured: room
# for a real answer. The toy task's answers are 3 tokens (two digits and end-of-sequence).
DATASET_RESPONSE_LEN = 1024
TOY_RESPONSE_LEN = 4


@dataclass
class Task:
    """Train and held-out prompts; `exact` judges eval accuracy (None: reward >= 1);
    `heldout_source` says where the held-out prompts come from (shown to the operator)."""

    name: str
    train: list[Item]
    heldout: list[Item]
    exact: Callable[[str, str, bool], bool] | None = None
    heldout_source: str = ""
    response_len: int = DATASET_RESPONSE_LEN  # the default max_new_tokens of this task
    notes: tuple[str, ...] = ()  # what the operator should know of the data (`tandem up` says)

    @property
    def longest_prompt(self) -> int:
        """The longest prompt, train or held out, in tokens."""
        return max(len(item.input_ids) for item in self.train + self.heldout)


def prompt_problem(tokenizer: Any, prompt: Any, chat: bool) -> str:
    """Why `prompt` (a row's) cannot be encoded ("" when it can)."""
    if isinstance(prompt, list):
        if not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt):
            return 'chat messages must be objects with "role" and "content"'
    elif not isinstance(prompt, str):
        return (
            f"the prompt must be a string or a list of chat messages, not {type(prompt).__name__}"
        )
    if (isinstance(prompt, list) or chat) and not getattr(tokenizer, "chat_template", None):
        what = "--apply-chat-template" if chat else "a chat-message prompt"
        return (
            f"{what} needs the tokenizer's chat template, and the --model tokenizer has none "
            "(chat_template in tokenizer_config.json): give text prompts, or a model with one"
        )
    return ""


def read_rows(path: str, flag: str = "--prompt-data") -> list[tuple[int, Any]]:
    """(row number, row) of each row of a data file (`numbered_rows`, or Parquet); errors name
    the file and line (or the flag)."""
    if problem := not_a_file(path, flag):
        raise ValueError(problem)
    if Path(path).suffix == ".parquet":
        return list(enumerate(parquet(path, lambda pq: pq.read_table(path).to_pylist()), 1))
    return list(numbered_rows(path))


def numbered_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a file of JSON lines (the number: the line's), or of one JSON array
    of rows (a file whose first line starts with `[`), compressed with gzip (.gz) or not; a
    UTF-8 byte-order mark is skipped; ValueError naming the file and line."""
    seen = False
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as data:
            for number, raw in enumerate(data, 1):
                line = utf8(path, number, raw.removeprefix(BOM) if number == 1 else raw)
                if not line.strip():
                    continue
                if not seen and line.lstrip().startswith("["):
                    yield from enumerate(
                        json_array(path, number, line + utf8(path, number + 1, data.read())), 1
                    )
                    return
                seen = True
                yield number, json_row(path, number, line)
    except (OSError, EOFError) as exc:  # (gzip's BadGzipFile is an OSError)
        raise ValueError(f"{path}: cannot be read ({exc})") from None


def utf8(path: str, number: int, raw: bytes) -> str:
    """`raw` (from line `number` of `path` on) as text; ValueError naming the line."""
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        line = number + raw.count(b"\n", 0, exc.start)
        raise ValueError(f"{path}:{line}: not UTF-8 text ({exc}): save the file as UTF-8") from None


def json_array(path: str, number: int, text: str) -> list[Any]:
    """The rows of a JSON array that starts at line `number` of `path`."""
    try:
        return json.loads(text)  # type: ignore[no-any-return]
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}:{number + exc.lineno - 1}: not JSON ({exc.msg}; a file that starts with [ "
            "is read as one JSON array of rows)"
        ) from None


def not_a_file(path: str, flag: str) -> str:
    """Why `path` given as `flag` cannot be read at all ("" when it can be)."""
    if Path(path).is_file():
        return ""
    return f"{flag} {path}: {'not a file' if Path(path).exists() else 'no such file'}"


def parquet(path: str, read: Callable[[Any], T]) -> T:
    """`read(pyarrow.parquet)` of a .parquet file; ValueError naming it when it is none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return read(pq)
    except pa.ArrowException as exc:
        raise ValueError(f"{path}: not a Parquet file ({exc})") from exc


def json_row(path: str, number: int, line: str) -> Any:
    """Line `number` of a .jsonl file, parsed; ValueError naming the file and line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        hint = "" if ".jsonl" in path else "; a data file is JSON lines, a JSON array or .parquet"
        raise ValueError(f"{path}:{number}: not JSON ({exc}{hint})") from exc


def row_problem(path: str, number: int, row: Any, input_key: str) -> str:
    """Why a parsed row holds no prompt under `input_key` ("" when it does)."""
    if isinstance(row, dict) and input_key in row:
        return ""
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    return f"{no_input_key(path, number, input_key)}: it has {keys}"


def no_input_key(path: str, number: int, input_key: str) -> str:
    return (
        f"{path}: row {number} has no {input_key!r} (--input-key, a flag of tandem up and of the "
        "router, names the prompt's field)"
    )


def data_problem(path: str, flag: str, input_key: str) -> str:
    """Why a data file given as `flag` cannot be trained or evaluated on ("" when it can, or
    none is given): `not_a_file`, then `first_row_problem`."""
    return path and (not_a_file(path, flag) or first_row_problem(path, input_key))


def first_row_problem(path: str, input_key: str) -> str:
    """Why the first row of `path` that cannot be read as a prompt cannot ("" when every row
    can), for `tandem up` before anything starts: a bad line the router would find at its
    start is found before the engines load (minutes, with a real model). A .parquet file's
    schema only."""
    if Path(path).suffix == ".parquet":
        try:
            names = parquet(path, lambda pq: pq.read_schema(path).names)
        except ValueError as exc:
            return str(exc)
        return "" if input_key in names else f"{no_input_key(path, 1, input_key)}: it has {names}"
    seen = False
    try:
        for number, row in numbered_rows(path):
            if problem := row_problem(path, number, row, input_key):
                return problem
            seen = True
    except ValueError as exc:
        return str(exc)
    return "" if seen else f"{path}: no rows"


def load_items(
    tokenizer: Any,
    path: str,
    input_key: str,
    label_key: str,
    chat: bool,
    flag: str,
    context_len: int = 0,
) -> tuple[list[Item], tuple[str, ...]]:
    """The rows of `path` as items, and notes for the console: rows without a label (absent,
    null or empty) are left out, before their prompts are tokenized, when others have one
    (`label_notes`); rows whose prompt fills the model's `context_len` positions (0: unknown)
    are left out, since no response fits after them, and ValueError when that is every row."""
    rows, notes = labelled_rows(path, input_key, label_key, flag)
    items, more = tokenized(tokenizer, rows, path, chat, flag, context_len)
    return items, notes + more


Row = tuple[int, Any, str]  # (row number, prompt, label)


def labelled_rows(
    path: str, input_key: str, label_key: str, flag: str
) -> tuple[list[Row], tuple[str, ...]]:
    """The rows of `path` with a prompt (and with a label, when some have one), and notes."""
    rows, unlabeled, empty, structured = [], [], [], []
    for number, row in read_rows(path, flag):
        if problem := row_problem(path, number, row, input_key):
            raise ValueError(problem)
        prompt = row[input_key]
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            empty.append(number)  # (a prompt of nothing asks for nothing)
            continue
        label = row.get(label_key)
        if isinstance(label, list | dict) and label:
            structured.append((number, label))
        label = "" if label is None else label if isinstance(label, str) else json.dumps(label)
        if not label:
            unlabeled.append(number)
        rows.append((number, prompt, label))
    if not rows:
        raise ValueError(f"{flag} {path}: no rows" + (" with a prompt" if empty else ""))
    notes = label_notes(path, len(rows), unlabeled, label_key)
    if empty:
        notes += (
            f"{len(empty)} rows of {path} have an empty {input_key!r} (the first: row "
            f"{empty[0]}): left out, a prompt of nothing asks for nothing",
        )
    if structured:
        number, label = structured[0]
        notes += (
            f"{len(structured)} of {len(rows)} rows of {path} have a {label_key!r} that is a "
            f"JSON list or object (the first: row {number}, {json.dumps(label)[:80]}): a reward "
            "gets it as that JSON text, which the built-in rewards (--rm-type) compare the "
            "response with and score 0; a --custom-rm-path function can json.loads it",
        )
    if unlabeled and len(unlabeled) < len(rows):
        rows = [(number, prompt, label) for number, prompt, label in rows if label]
    return rows, notes


def tokenized(
    tokenizer: Any, rows: list[Row], path: str, chat: bool, flag: str, context_len: int
) -> tuple[list[Item], tuple[str, ...]]:
    """The rows as items, without those whose prompt fills `context_len` (with a note)."""
    items, too_long, unknown = [], [], []
    unk = getattr(tokenizer, "unk_token_id", None)  # (None: a byte-level tokenizer knows all)
    started = said = time.monotonic()
    for k, (number, prompt, label) in enumerate(rows):
        if k % 1000 == 0 and time.monotonic() - said >= PROGRESS_S:
            said = time.monotonic()
            log.info("%s: %d of %d rows tokenized (%.0f s)", path, k, len(rows), said - started)
        if problem := prompt_problem(tokenizer, prompt, chat):
            raise ValueError(f"{path}: row {number}: {problem}")
        messages = (
            tuple((m["role"], m["content"]) for m in prompt) if isinstance(prompt, list) else ()
        )
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        try:
            item = Item(text, label, encode_prompt(tokenizer, prompt, chat), messages)
        except MessageError as exc:
            raise ValueError(f"{path}: row {number}: {exc}") from None
        if unk is not None and unk in item.input_ids:
            unknown.append((number, prompt))
        if context_len and len(item.input_ids) >= context_len:
            too_long.append((number, len(item.input_ids)))
        else:
            items.append(item)
    notes = (unknown_note(tokenizer, unknown, len(rows), path),) if unknown else ()
    if too_long:
        number, length = too_long[0]
        what = (
            f"prompts of at least {context_len} tokens, the model's context (max_position_"
            f"embeddings; the first: row {number}, {length} tokens): no response fits after them"
        )
        if not items:
            raise ValueError(f"{flag} {path}: every row has {what}")
        left_out = (
            f"{len(too_long)} of {len(rows)} rows of {path} have {what}: left out (shorten "
            "them, or train a model with a longer context)"
        )
        return items, (*notes, left_out)
    return items, notes


def unknown_pieces(tokenizer: Any, prompt: Any) -> list[str]:
    """The pieces of `prompt`'s text (a chat prompt's contents) that `tokenizer` turns into its
    unknown token; [] where it cannot say (a tokenizer without offsets)."""
    texts = [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt]
    pieces = []
    for text in (t for t in texts if isinstance(t, str)):
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, TypeError, ValueError):
            return []
        spans = zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        pieces += [text[a:b] for t, (a, b) in spans if t == tokenizer.unk_token_id]
    return pieces


def unknown_note(tokenizer: Any, rows: list[tuple[int, Any]], total: int, path: str) -> str:
    """The console's note on `rows` (number, prompt) whose prompts hold tokens `tokenizer`
    does not know: each became its unknown token, so the model never sees what was there."""
    counts = Counter(
        piece for _n, prompt in rows[:1000] for piece in unknown_pieces(tokenizer, prompt)
    )
    what = ", ".join(f"{piece!r} ({n}x)" for piece, n in counts.most_common(10)) or "not told"
    return (
        f"{len(rows)} of {total} prompts of {path} hold text the model's tokenizer does not "
        f"know (the first: row {rows[0][0]}; unknown: {what}): each such piece became "
        f"{tokenizer.unk_token!r}, so the model trains on those prompts without it (the toy "
        "model knows only digits, '>' and '='): use a --model whose tokenizer knows them, or "
        "rewrite those prompts"
    )


def toy_reverse_digits(tokenizer: Any, seed: int) -> Task:
    """The built-in reverse-two-digits task, tokenized once with the model's tokenizer."""
    train, heldout = reverse_digits_split(seed)

    def items(raw: list) -> list[Item]:
        return [Item(t.prompt, t.label, encode_prompt(tokenizer, t.prompt, False)) for t in raw]

    source = f"{len(heldout)} held-out digit pairs (--task-seed {seed})"
    return Task("reverse_digits", items(train), items(heldout), is_exact, source, TOY_RESPONSE_LEN)


def dataset_task(
    tokenizer: Any,
    train_path: str,
    eval_path: str,
    input_key: str,
    label_key: str,
    chat: bool,
    heldout_fraction: float = 0.0,
    seed: int = 0,
    context_len: int = 0,
    eval_max: int = 0,
) -> Task:
    """The dataset's prompts; held out for evaluation: `eval_path`'s, else `heldout_fraction`
    of `train_path`'s (at least one, chosen by `seed`, then not trained on), at most
    `eval_max` of either (0: all; a subset chosen by `seed`). Prompts that fill the model's
    `context_len` positions are left out (`load_items`)."""
    keys = (input_key, label_key, chat)
    train, notes = load_items(tokenizer, train_path, *keys, "--prompt-data", context_len)
    name = Path(train_path).stem
    if eval_path:
        heldout, more = load_items(tokenizer, eval_path, *keys, "--eval-prompt-data", context_len)
        notes += tuple(note for note in more if note not in notes)  # (the same file: said once)
        source = f"{len(heldout)} prompts of {eval_path}"
        if eval_max and len(heldout) > eval_max:
            heldout = [
                heldout[i]
                for i in sorted(random.Random(seed).sample(range(len(heldout)), eval_max))
            ]
            source = f"{eval_max} of the {source} (--eval-max-prompts)"
        trained = {tuple(item.input_ids) for item in train}
        if shared := sum(tuple(item.input_ids) in trained for item in heldout):
            notes += (
                f"{shared} of the {len(heldout)} held-out prompts ({eval_path}) are prompts of "
                f"{train_path} too: the held-out accuracy counts prompts the run trains on (give "
                "--eval-prompt-data a file of other prompts, or leave it out: "
                "--eval-heldout-fraction then holds prompts of --prompt-data out of training)",
            )
        return Task(name, train, heldout, heldout_source=source, notes=notes)
    count = min(max(1, round(heldout_fraction * len(train))), len(train) - 1)
    capped = bool(eval_max) and count > eval_max
    count = min(count, eval_max) if eval_max else count
    if heldout_fraction <= 0 or count < 1:
        return Task(name, train, [], heldout_source="none (no --eval-prompt-data)", notes=notes)
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    source = (
        f"{count} prompts held out of {train_path} (--eval-heldout-fraction {heldout_fraction}"
        f"{', at most --eval-max-prompts' if capped else ''}; --eval-prompt-data sets a file)"
    )
    return Task(
        name,
        [it for i, it in enumerate(train) if i not in held],
        [train[i] for i in sorted(held)],
        heldout_source=source,
        notes=notes,
    )


def label_notes(path: str, rows: int, unlabeled: list[int], label_key: str) -> tuple[str, ...]:
    """When no row of `path` has a label (most likely the labels are under another key), or
    some have none (their rows are left out: a reward would compare responses with "")."""
    flag = "--label-key, a flag of tandem up and of the router, names the label's field"
    if len(unlabeled) == rows:
        return (
            f"no row of {path} has a {label_key!r}: every label is empty, so a reward that "
            f"compares the response with its label scores 0 ({flag})",
        )
    if unlabeled:
        have = "has" if len(unlabeled) == 1 else "have"
        return (
            f"{len(unlabeled)} of {rows} rows of {path} {have} no {label_key!r} (the first: row "
            f"{unlabeled[0]}): left out, a reward would compare their responses with an empty "
            f"label ({flag})",
        )
    return ()


def data_term(task: Task) -> str:
    """The run contract's `data` (proto/run_terms.py): the training rows' count and a digest of
    their prompts as drawn (input ids, in order) and labels (a changed file, tokenizer, chat
    template or held-out split changes it; the file's path does not)."""
    digest = hashlib.sha256()
    for item in task.train:
        digest.update(len(item.input_ids).to_bytes(4, "little"))
        digest.update(array("i", item.input_ids).tobytes())
        digest.update(item.label.encode() + b"\0")
    return f"{len(task.train)} prompts, sha256 {digest.hexdigest()[:16]}"
