"""Dataset files as the router reads them, without a router process: the forms a file may
take, rows left out and said so, prompts that cannot be encoded, the held-out prompts and the
progress of a long read."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from services.common.tokenizers import load_tokenizer
from services.rollout_router.rollout.tasks import dataset_task, first_row_problem, load_items


def test_prompts_that_cannot_be_encoded_are_refused_naming_the_row(toy_model_dir, tmp_path):
    """Chat messages for a tokenizer without a chat template (the toy model's), messages
    without a role, a prompt that is neither text nor messages: the row and the fix, where
    the tokenizer raised its own error or a KeyError."""
    tokenizer = load_tokenizer(str(toy_model_dir))
    data = tmp_path / "train.jsonl"
    cases = {
        '[{"role": "user", "content": "12"}]': "row 2: a chat-message prompt needs the "
        "tokenizer's chat template, and the --model tokenizer has none",
        '[{"content": "12"}]': 'row 2: chat messages must be objects with "role" and "content"',
        '{"q": 1}': "row 2: the prompt must be a string or a list of chat messages, not dict",
    }
    for prompt, expected in cases.items():
        data.write_text(f'{{"prompt": "12>", "label": "21"}}\n{{"prompt": {prompt}, "label": "1"}}')
        with pytest.raises(ValueError, match=re.escape(f"{data}: {expected}")):
            load_items(tokenizer, str(data), "prompt", "label", False, "--prompt-data")
    data.write_text('{"prompt": "12>", "label": "21"}')
    with pytest.raises(ValueError, match="--apply-chat-template needs the tokenizer's chat"):
        load_items(tokenizer, str(data), "prompt", "label", True, "--prompt-data")
    assert len(load_items(tokenizer, str(data), "prompt", "label", False, "--prompt-data")[0]) == 1


def test_the_held_out_prompts_are_at_most_eval_max_prompts(toy_model_dir, tmp_path):
    """5% of a large dataset, or a large eval file, evaluated at every version takes engine
    time from rollouts: at most --eval-max-prompts of them, a fixed subset, the rest trained."""
    tokenizer = load_tokenizer(str(toy_model_dir))
    rows = [json.dumps({"prompt": f"{i % 100:02d}>", "label": str(i)}) for i in range(400)]
    (tmp_path / "train.jsonl").write_text("\n".join(rows))
    (tmp_path / "eval.jsonl").write_text("\n".join(rows[:300]))
    data = (str(tmp_path / "train.jsonl"), "", "prompt", "label", False)
    task = dataset_task(tokenizer, *data, heldout_fraction=0.5, seed=3, eval_max=50)
    assert (len(task.heldout), len(task.train)) == (50, 350)
    assert "--eval-heldout-fraction 0.5, at most --eval-max-prompts" in task.heldout_source
    assert len(dataset_task(tokenizer, *data, heldout_fraction=0.5, seed=3).heldout) == 200
    evals = (str(tmp_path / "train.jsonl"), str(tmp_path / "eval.jsonl"), "prompt", "label")
    task = dataset_task(tokenizer, *evals, False, seed=3, eval_max=50)
    again = dataset_task(tokenizer, *evals, False, seed=3, eval_max=50)
    assert len(task.heldout) == 50 and task.heldout == again.heldout and len(task.train) == 400
    assert task.heldout_source == f"50 of the 300 prompts of {evals[1]} (--eval-max-prompts)"
    # (held out of nothing: every one is trained on, which the run said nowhere)
    assert task.notes == (
        f"50 of the 50 held-out prompts ({evals[1]}) are prompts of {evals[0]} too: the held-out "
        "accuracy counts prompts the run trains on (give --eval-prompt-data a file of other "
        "prompts, or leave it out: --eval-heldout-fraction then holds prompts of --prompt-data "
        "out of training)",
    )
    assert not dataset_task(tokenizer, *data, heldout_fraction=0.5, seed=3).notes
    # one file as both: what is said of its rows is said once (it was said twice)
    long_row = json.dumps({"prompt": "1" * 80 + ">", "label": "1"})
    (tmp_path / "both.jsonl").write_text("\n".join([*rows[:10], long_row]))
    both = (str(tmp_path / "both.jsonl"),) * 2
    notes = dataset_task(tokenizer, *both, "prompt", "label", False, context_len=64).notes
    assert [note[:32] for note in notes] == [
        "1 of 11 rows of " + both[0][:16],
        "10 of the 10 held-out prompts (" + both[0][:1],
    ]


def test_a_long_dataset_read_says_how_far_it_is(toy_model_dir, tmp_path, monkeypatch, caplog):
    """A million chat prompts take minutes to tokenize: the router's log (the last line of
    which tandem up prints while the router starts) says how many of how many rows are done."""
    from services.rollout_router.rollout import tasks

    tokenizer = load_tokenizer(str(toy_model_dir))
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": "12>", "label": "21"}) + "\n" for _ in range(2500))
    )
    monkeypatch.setattr(tasks, "PROGRESS_S", 0.0)
    with caplog.at_level("INFO", logger="tandem.router.data"):
        load_items(tokenizer, str(data), "prompt", "label", False, "--prompt-data")
    said = [r.getMessage() for r in caplog.records]
    assert [s.split(" (")[0] for s in said] == [
        f"{data}: {k} of 2500 rows tokenized" for k in (0, 1000, 2000)
    ]


def test_rows_with_an_empty_prompt_are_left_out_and_said_so(toy_model_dir, tmp_path):
    """A prompt of "" (or blanks, or no messages) asks for nothing: the old code trained on it
    without a word. Its labels do not count as missing either."""
    tokenizer = load_tokenizer(str(toy_model_dir))
    data = tmp_path / "train.jsonl"
    rows = [("12>", "21"), ("", "3"), ("  ", ""), ([], "4"), ("34>", "43")]
    data.write_text("\n".join(json.dumps({"prompt": p, "label": a}) for p, a in rows))
    items, notes = load_items(tokenizer, str(data), "prompt", "label", False, "--prompt-data")
    assert [item.prompt for item in items] == ["12>", "34>"]
    assert notes == (
        f"3 rows of {data} have an empty 'prompt' (the first: row 2): left out, a prompt of "
        "nothing asks for nothing",
    )
    data.write_text(json.dumps({"prompt": "", "label": "1"}))
    with pytest.raises(ValueError, match=r"train.jsonl: no rows with a prompt"):
        load_items(tokenizer, str(data), "prompt", "label", False, "--prompt-data")


def test_a_json_array_gzip_and_a_byte_order_mark_are_read_and_other_text_named(
    toy_model_dir, tmp_path
):
    """A JSON array of rows (json.dump's), a .gz file, a UTF-8 byte-order mark: the old code
    took the array for one row ('it has list'), a .gz file and a mark for lines that are not
    JSON; a Latin-1 file failed the router's start naming neither the file nor the line."""
    tokenizer = load_tokenizer(str(toy_model_dir))
    rows = [{"prompt": f"{k}{k}>", "label": f"{k}{k}"} for k in range(1, 4)]
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    forms = {
        "pretty.json": json.dumps(rows, indent=2).encode(),
        "one_line.json": b"\n" + json.dumps(rows).encode(),
        "rows.jsonl.gz": gzip.compress(lines.encode()),
        "rows.json.gz": gzip.compress(json.dumps(rows).encode()),
        "windows.jsonl": b"\xef\xbb\xbf" + lines.encode(),
    }
    for name, data in forms.items():
        (tmp_path / name).write_bytes(data)
        items, _ = load_items(tokenizer, str(tmp_path / name), "prompt", "label", False, "x")
        assert [(i.prompt, i.label) for i in items] == [("11>", "11"), ("22>", "22"), ("33>", "33")]
        assert first_row_problem(str(tmp_path / name), "prompt") == "", name
    bad = {
        "latin.jsonl": (lines + '{"prompt": "café"}\n').encode("latin-1"),
        "cut.json": json.dumps(rows, indent=2).encode()[:-3],
        "plain.jsonl.gz": lines.encode(),
    }
    expected = {
        "latin.jsonl": "latin.jsonl:4: not UTF-8 text (",
        "cut.json": "cut.json:13: not JSON (Expecting ',' delimiter; a file that starts with [ "
        "is read as one JSON array of rows)",
        "plain.jsonl.gz": "plain.jsonl.gz: cannot be read (Not a gzipped file",
    }
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
        assert expected[name] in first_row_problem(str(tmp_path / name), "prompt")
        with pytest.raises(ValueError, match=re.escape(expected[name])):
            load_items(tokenizer, str(tmp_path / name), "prompt", "label", False, "x")
