"""`tandem engine` refuses bad flags with exit code 2 and one line naming the flag to fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.serving import bind_socket


def engine_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "engine", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--model is required"),
        (["--model", "/nonexistent/model"], "/nonexistent/model/config.json not found: --model"),
        (["--model", "{toy}", "--max-batch-size", "0"], "--max-batch-size must be at least 1"),
    ],
)
def test_bad_flags_exit_2_with_a_message_naming_the_flag(
    toy_model_dir: Path, args: list[str], message: str
) -> None:
    result = engine_cli(*[a.format(toy=toy_model_dir) for a in args])
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]


def test_a_taken_port_is_named_in_the_error(toy_model_dir: Path) -> None:
    sock = bind_socket("127.0.0.1", 0)
    sock.listen()
    port = sock.getsockname()[1]
    try:
        result = engine_cli("--model", str(toy_model_dir), "--port", str(port))
    finally:
        sock.close()
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "--port" in result.stderr
