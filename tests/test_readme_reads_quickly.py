"""The README stays a page read in five minutes: a bound on its lines and on the longest cell of
its tables. Detail belongs in docs/ (docs/benchmarks.md holds each figure's history and caveats);
the links from the README to it are checked by tests/test_docs.py."""

from __future__ import annotations

import re

from tests.test_docs import FENCE, ROOT

README = ROOT / "README.md"
MAX_LINES = 200
MAX_CELL_CHARS = 200  # (one figure, its machine and its command; the story is in docs/)


def table_cells(text: str) -> list[str]:
    """Every cell of every Markdown table outside code blocks, stripped (a `\\|` stays in its
    cell)."""
    cells = []
    for line in FENCE.sub("", text).splitlines():
        if line.lstrip().startswith("|"):
            row = line.strip().strip("|")
            cells += [cell.strip() for cell in re.split(r"(?<!\\)\|", row)]
    return cells


def test_the_readme_is_at_most_200_lines():
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines (at most {MAX_LINES}): move detail to docs/"
    )


def test_no_readme_table_cell_is_longer_than_200_characters():
    cells = table_cells(README.read_text())
    assert len(cells) > 50, "the README's tables were not found"  # (the check sees them)
    long = [cell for cell in cells if len(cell) > MAX_CELL_CHARS]
    assert not long, f"README.md table cells over {MAX_CELL_CHARS} characters: {long}"


def test_table_cells_splits_rows_and_leaves_code_blocks_out():
    text = "| a | b \\| c |\n|---|---|\n```\n| not | a table |\n```\n"
    assert table_cells(text) == ["a", "b \\| c", "---", "---"]
