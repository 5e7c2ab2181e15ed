"""The docs hold together: every relative link resolves, every `tandem CMD` in a code block is a
real subcommand, and the README links every page under docs/."""

from __future__ import annotations

import re
from pathlib import Path

from tandem.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [
        ROOT / "README.md",
        ROOT / "examples/README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "services").glob("*/README.md"),
    ]
)
# Pages another change generates (`tandem config`): linked from here before they exist.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.MULTILINE | re.DOTALL)
COMMAND = re.compile(r"(?:^|[\s;&|(`])tandem[ \t]+([a-z][a-z0-9-]*)", re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    slugs = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def broken_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())  # a link inside a code block is not a link
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    problems = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{name}: link {target!r}: no file {path}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{name}: link {target!r}: no heading #{anchor}")
    return problems


def test_every_relative_link_in_the_docs_resolves_to_a_file_and_heading():
    assert len(DOCS) >= 8, DOCS
    problems = [problem for page in DOCS for problem in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_every_tandem_command_in_a_code_block_is_a_real_subcommand():
    named: dict[str, list[str]] = {}
    for page in DOCS:
        for block in FENCE.finditer(page.read_text()):
            for command in COMMAND.findall(block.group(2)):
                named.setdefault(command, []).append(str(page.relative_to(ROOT)))
    assert {"up", "convert", "engine", "trainer"} <= set(named), sorted(named)
    unknown = {command: pages for command, pages in named.items() if command not in COMMANDS}
    assert not unknown, f"not a `tandem` subcommand ({', '.join(COMMANDS)}): {unknown}"


def test_the_readme_links_every_page_under_docs():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(readme)}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, f"README.md does not link docs/{missing}"


def test_every_no_flag_the_docs_name_turns_off_a_setting_that_is_on_by_default():
    """A page saying "turn that off with --no-X" where X is off already sends the reader after
    nothing (train-your-model.md said so of --dynamic-sampling, off unless given)."""
    from services.common.settings import flat
    from tandem.up_tree import SERVICES

    on_by_tandem_up = {"--no-bf16"}  # (tandem up gives a --model's trainer on a GPU --bf16)
    defaults = {
        f"--no-{leaf.replace('_', '-')}": value
        for config in SERVICES.values()
        for leaf, value in flat(config()).items()
        if isinstance(value, bool)
    }
    named = {flag for page in DOCS for flag in re.findall(r"--no-[a-z0-9-]+", page.read_text())}
    assert "--no-rollout" in named & defaults.keys()  # (the check sees the flags it is about)
    off_already = sorted(f for f in named & defaults.keys() - on_by_tandem_up if not defaults[f])
    assert not off_already, f"the docs say to turn off what is off by default: {off_already}"


def test_the_checks_catch_a_broken_link_and_an_unknown_command(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[gone](missing.md) [top](#top) [nowhere](#nowhere)\n")
    problems = broken_links(page)
    assert len(problems) == 2 and "missing.md" in problems[0] and "#nowhere" in problems[1]
    assert COMMAND.findall("$ tandem serve --x\n  tandem up") == ["serve", "up"]
