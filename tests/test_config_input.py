"""Bad input to the configuration (files, pass-through strings, variables, URLs): each is
refused with exit code 2 and a message naming what to change, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.settings import load
from services.rollout_router.config import RouterConfig
from tandem import launcher

ROOT = Path(__file__).resolve().parents[1]


def tandem(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess (`tandem config show` starts nothing)."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "tandem.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=120, cwd=ROOT)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read it (Is a directory)"),
        (b"\xff\xfe[up]\n", "not a text file (not UTF-8"),
        (b"max_steps = 5\n", "max_steps = 5 is outside any table: put it under"),
    ],
)
def test_a_config_that_is_a_folder_binary_or_keys_outside_a_table_exits_2_naming_it(
    tmp_path: Path, capsys, content: bytes | None, expected: str
) -> None:
    path = tmp_path / "run.toml"
    path.mkdir() if content is None else path.write_bytes(content)
    with pytest.raises(SystemExit) as exc:
        load(RouterConfig, ["--config", str(path)], "router")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{path}" in err and expected in err, err
    shown = tandem("config", "show", "--config", str(path))
    assert shown.returncode == 2 and expected in shown.stderr, shown.stderr
    assert "Traceback" not in shown.stderr


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ([], {"TANDEM_UP_ENGINE_GPUS": '"0'}, "environment variable TANDEM_UP_ENGINE_GPUS"),
        (
            [],
            {"TANDEM_ROUTER_ROLLOUT_STOP": "'x"},
            "environment variable TANDEM_ROUTER_ROLLOUT_STOP",
        ),
    ],
)
def test_an_unclosed_quote_in_a_list_variable_exits_2_naming_it(
    args: list[str], env: dict[str, str], expected: str
) -> None:
    shown = tandem("config", "show", *args, env=env)
    assert shown.returncode == 2, shown.stderr
    assert expected in shown.stderr and "No closing quotation" in shown.stderr, shown.stderr
    assert "Traceback" not in shown.stderr


@pytest.mark.parametrize("url", ["notaurl", "http://127.0.0.1:6379", "redis://127.0.0.1:99999/0"])
def test_a_redis_url_redis_cannot_use_exits_2_naming_the_flag_not_a_traceback(
    tmp_path: Path, url: str
) -> None:
    from services.trainer.config import TrainerConfig

    up = tandem("up", "--redis-url", url, "--run-dir", str(tmp_path / "run"), "--max-steps", "1")
    assert up.returncode == 2 and f"--redis-url/REDIS_URL {url!r}" in up.stderr, up.stderr
    from_env = tandem("config", "show", env={"REDIS_URL": url})
    assert from_env.returncode == 2 and f"REDIS_URL {url!r}" in from_env.stderr, from_env.stderr
    router = tandem("router", "--no-rollout", "--port", "0", "--redis-url", url)
    assert router.returncode == 2 and f"--redis-url {url!r}" in router.stderr, router.stderr
    with pytest.raises(ValueError, match="--redis-url"):
        TrainerConfig(model=str(tmp_path), redis_url=url).validate()
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


@pytest.mark.parametrize("service", ["router", "broker", "trainer"])
def test_a_ready_file_that_cannot_be_written_exits_2_before_the_service_starts(
    tmp_path: Path, service: str
) -> None:
    flags = {
        "router": ["--no-rollout", "--port", "0", "--redis-url", "redis://127.0.0.1:1/0"],
        "broker": ["--port", "0"],
        "trainer": ["--model", str(tmp_path)],  # (no model there: the check comes first)
    }[service]
    for path, expected in (
        (tmp_path / "gone" / "ready.json", "no such folder"),
        (tmp_path, "a folder"),
    ):
        run = tandem(service, *flags, "--ready-file", str(path))
        assert run.returncode == 2, run.stderr
        assert f"--ready-file {path}: " in run.stderr and expected in run.stderr, run.stderr
        assert "Traceback" not in run.stderr


def test_a_response_bound_of_the_models_context_or_more_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    up = tandem(
        "up",
        "--run-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "1",
        "--rollout-max-response-len",
        "64",  # the toy model's max_position_embeddings
    )
    assert up.returncode == 2, up.stdout[-2000:] + up.stderr[-2000:]
    expected = "--rollout-max-response-len 64: the model's context is 64 positions"
    assert expected in up.stdout + up.stderr and "Traceback" not in up.stderr, up.stderr


def test_trainer_processes_the_tensor_parallel_size_does_not_divide_are_refused_at_start() -> None:
    args = ["--tensor-model-parallel-size", "3", "--trainer-procs", "2"]
    _config, problems = launcher.parse(args)
    assert len(problems) == 1, problems
    assert "--trainer-procs 2" in problems[0] and "--tensor-model-parallel-size 3" in problems[0]
    _config, problems = launcher.parse([*args[:2], "--trainer-procs", "3"])
    assert problems == []


def test_tandem_config_show_names_itself_in_its_errors_not_tandem_up(capsys, monkeypatch) -> None:
    """`tandem config show --bogus` said `tandem up: error: ...` (and its usage line
    `usage: tandem up ...`): the command that refused was not the one typed."""
    from tandem import config_cmd

    cases: list[tuple[list[str], dict[str, str], str]] = [
        (["--bogus"], {}, "tandem config show: unrecognized argument --bogus"),
        (["--lr", "nan"], {}, "tandem config show: trainer: --lr nan: "),
        ([], {"TANDEM_UP_MAX_STEP": "5"}, "tandem config show: environment variable"),
    ]
    for argv, env, said in cases:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert config_cmd.main(["show", *argv]) == 2
        err = capsys.readouterr().err
        assert said in err and "tandem up" not in err, (argv, err)
        for name in env:
            monkeypatch.delenv(name)
    assert launcher.main(["--bogus"]) == 2  # tandem up itself still says tandem up
    assert "tandem up: unrecognized argument --bogus" in capsys.readouterr().err
