"""A `--custom-rm-path` file that cannot work is refused by `tandem up` before anything starts.

Before, a syntax error or a function that does not take (response_text, label, stopped) was
found only by the router, after Redis and the engines had started (22-37 s), and left a run
folder behind. The check compiles the file and reads the function's parameters; it runs none of
the user's code. Each test runs the real CLI as a process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.rollout_router.rollout.custom_reward import import_problem

DATA = '{"prompt": "1 2", "label": "2 1"}\n'


def up_in(folder: Path, reward: str) -> subprocess.CompletedProcess[str]:
    """`tandem up` from `folder` (which holds data.jsonl) scored by `reward`, default run folder."""
    flags = ["--prompt-data", "data.jsonl", "--custom-rm-path", reward]
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "up", *flags],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "data.jsonl").write_text(DATA)
    return tmp_path


def test_a_reward_file_with_a_syntax_error_is_refused_at_start_naming_its_file_and_line(
    project: Path,
) -> None:
    (project / "rewards.py").write_text(
        "import math\n\ndef score(text, label, stopped)\n    return 1.0\n"
    )
    result = up_in(project, "rewards.py:score")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{project / 'rewards.py'}:3: syntax error: expected ':'" in result.stderr
    assert not (project / "runs").exists(), "a refused start leaves no run folder"


def test_a_reward_function_without_the_three_parameters_is_refused_at_start_naming_them(
    project: Path,
) -> None:
    (project / "my_rewards.py").write_text(
        "open('ran', 'w').close()\n\ndef score(text, label):\n    return 1.0\n"
    )
    result = up_in(project, "my_rewards:score")
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        "--custom-rm-path my_rewards:score: score(text, label) "
        f"({project / 'my_rewards.py'}:3) cannot be called as "
        "score(response_text, label, stopped)"
    ) in result.stderr
    assert not (project / "runs").exists(), "a refused start leaves no run folder"
    assert not (project / "ran").exists(), "the check ran the user's module"


def test_reward_functions_that_take_the_three_parameters_pass_the_check_unrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('the package ran')\n")
    (tmp_path / "pkg" / "rw.py").write_text(
        "def a(text, label, stopped, *, scale=1.0):\n    return 1.0\n\n"
        "async def b(*args):\n    return 1.0\n\n"
        "def c(text, label, stopped=True, extra=None):\n    return 1.0\n\n"
        "def d(text, label, stopped, *, scale):\n    return 1.0\n\n"
        "def e(text):\n    return 1.0\n\ne = lambda text, label, stopped: 1.0\n"  # (rebound)
    )
    for fn in ("a", "b", "c", "e"):
        assert import_problem(f"pkg.rw:{fn}") == "", fn
    assert "d(text, label, stopped, *, scale)" in import_problem("pkg.rw:d")
