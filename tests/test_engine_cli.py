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
        (["--model", "{toy}", "--max-batch-size", "0"], "--max-batch-size 0: must be at least 1"),
        # (admitted sequences outgrew the memory under load: the engine was killed then)
        (["--model", "{toy}", "--kv-cache-gb", "100000"], "--kv-cache-gb 100000 is more than"),
        # (each taken: -3 or 0 timed every weight update out, nan crashed the engine as it
        # started with "cannot convert float NaN to integer", a budget of nan bounded nothing)
        (
            ["--model", "{toy}", "--update-timeout-s", "0"],
            "--update-timeout-s 0: must be more than 0",
        ),
        (
            ["--model", "{toy}", "--update-timeout-s", "-3"],
            "--update-timeout-s -3: must be more than 0",
        ),
        (
            ["--model", "{toy}", "--update-timeout-s", "nan"],
            "--update-timeout-s nan: not a finite number",
        ),
        (["--model", "{toy}", "--kv-cache-gb", "nan"], "--kv-cache-gb nan: not a finite number"),
        # (it held 0 tokens, and 0 is unbounded)
        (["--model", "{toy}", "--kv-cache-gb", "1e-9"], "1e-09 holds 0 tokens of this model: no"),
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


def test_the_default_kv_budget_is_lowered_to_the_memory_free(monkeypatch, caplog) -> None:
    import psutil
    import torch

    from services.engine.engine import kv_budget

    free = type("Memory", (), {"available": 2 * 2**30})()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    cpu = torch.device("cpu")
    assert kv_budget(1.5, cpu) == 1.5 and kv_budget(0, cpu) == 0
    assert kv_budget(4, cpu) == pytest.approx(1.8)  # the default: 90% of what is free
    assert "--kv-cache-gb 4 is more than the 2.0 GiB free on cpu (the default)" in caplog.text
    with pytest.raises(RuntimeError, match=r"--kv-cache-gb 3 is more than the 2\.0 GiB free"):
        kv_budget(3, cpu)


def test_a_kv_budget_shorter_than_the_context_lowers_the_context(toy_model_dir: Path, caplog):
    """As SGLang caps a request's length at its KV pool: a sequence longer than the budget ran
    alone, beyond it (the toy model's cache takes 512 bytes a position; its context is 64)."""
    from services.engine.config import EngineConfig
    from services.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(toy_model_dir), kv_cache_gb=40 * 512 / 2**30))
    assert engine.context_length == engine.scheduler.context_length == 40
    assert "holds 40 tokens of this model: the context is lowered to it from 64" in caplog.text
    body = {"input_ids": [3] * 40, "sampling_params": {"max_new_tokens": 1}}
    with pytest.raises(ValueError, match=r"longer than the model's context length \(40 tokens\)"):
        engine.parse(body)
