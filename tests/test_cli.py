"""The `tandem` command: every subcommand answers --help, and deployment files match the CLIs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.cli import COMMANDS
from tests.helpers import serving

ROOT = Path(__file__).resolve().parents[1]


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_explains_itself(command: str) -> None:
    result = tandem(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"tandem {command}" in result.stdout
    assert len(result.stdout) > 300  # flags with their explanations, not a bare usage line
    # each flag states its default once, and only a default there is
    flags = " ".join(result.stdout.split()).split(" --")
    assert not [f for f in flags if "(default: )" in f or f.count("(default:") > 1]


def test_an_unknown_subcommand_fails_and_lists_the_real_ones() -> None:
    result = tandem("serve")
    assert result.returncode == 2
    assert "unknown command 'serve'" in result.stderr and "engine" in result.stderr


def test_a_taken_port_is_refused_with_its_number(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = tandem("broker", "--port", str(port))
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "--port" in result.stderr


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma 2 checkpoint's config.json (nothing else is read before the refusal)."""
    import json

    out = tmp_path_factory.mktemp("gemma2")
    config = {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "vocab_size": 16}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    "command", [["trainer"], ["engine"], ["router", "--redis-url", "redis://127.0.0.1:1/0"]]
)
def test_every_service_refuses_an_unsupported_model_type_in_one_line(
    gemma2_dir: Path, command: list[str]
) -> None:
    from proto.models import SUPPORTED_MODEL_TYPES

    result = tandem(*command, "--model", str(gemma2_dir))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "gemma2" in line]
    assert len(lines) == 1, result.stderr[-2000:]
    assert str(gemma2_dir / "config.json") in lines[0]
    assert "model_type 'gemma2' is not supported" in lines[0]
    assert all(t in lines[0] for t in SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("command", [["trainer"], ["engine", "--context-length", "64"]])
def test_a_sliding_window_shorter_than_the_context_is_refused_naming_the_field(
    tmp_path: Path, command: list[str]
) -> None:
    import json

    config = {"model_type": "mistral", "sliding_window": 32, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = tandem(*command, "--model", str(tmp_path))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{tmp_path / 'config.json'}: sliding_window 32" in result.stderr


def test_tandem_up_gives_each_run_its_own_token_and_weight_secret_and_keeps_the_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The token is in the run folder, readable by its owner only (the dashboard's pause and
    the API's writes need it); a token of the user's own stays where it is."""
    from tandem.run_dir import share_run_secrets

    names = ("TANDEM_API_TOKEN", "TANDEM_WEIGHT_SECRET")
    runs = []
    for _ in range(2):
        for name in names:
            monkeypatch.delenv(name, raising=False)
        assert share_run_secrets(tmp_path) == str(tmp_path / "api_token")
        runs.append([os.environ[name] for name in names])
        assert (tmp_path / "api_token").read_text() == os.environ["TANDEM_API_TOKEN"] + "\n"
        assert (tmp_path / "api_token").stat().st_mode & 0o777 == 0o600
    assert all(len(value) == 64 for value in runs[0]) and runs[0] != runs[1]
    monkeypatch.setenv("TANDEM_WEIGHT_SECRET", "chosen")
    monkeypatch.setenv("TANDEM_API_TOKEN", "mine")
    (tmp_path / "api_token").unlink()
    assert share_run_secrets(tmp_path) == "$TANDEM_API_TOKEN"
    assert (
        os.environ["TANDEM_WEIGHT_SECRET"] == "chosen" and os.environ["TANDEM_API_TOKEN"] == "mine"
    )
    assert not (tmp_path / "api_token").exists()


def test_toy_model_names_an_out_folder_it_cannot_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem import toy_model_cli

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert toy_model_cli.main(["--out", str(blocker / "model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem toy-model: cannot write --out {blocker / 'model'}: ")


def test_the_toy_model_is_made_once_then_copied_with_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made once per seed and shape (it imports torch and transformers: ~5 s of a toy run),
    then copied from the cache; with no cache folder to write in, made each time."""
    from tandem.toy_model import write_toy_model

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    first = write_toy_model(tmp_path / "a", seed=3)
    [kept] = (tmp_path / "cache" / "toy-models").iterdir()
    files = sorted(path.name for path in first.iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    (kept / "config.json").write_text("{}")  # a mark: the next write copies the kept one
    second = write_toy_model(tmp_path / "b", seed=3)
    assert (second / "config.json").read_text() == "{}"
    assert (second / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    other = write_toy_model(tmp_path / "c", seed=4)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker))
    made = write_toy_model(tmp_path / "d", seed=3)
    assert sorted(path.name for path in made.iterdir()) == files
    assert all((made / name).read_bytes() == (first / name).read_bytes() for name in files)


def test_a_model_folder_without_tokenizer_files_is_refused_naming_them(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    """transformers builds an empty tokenizer from a folder without tokenizer files: every
    prompt encoded to no tokens, and the run failed on the engines' refusals once started."""
    import shutil

    from services.common.tokenizers import load_tokenizer

    folder = tmp_path / "weights_only"
    shutil.copytree(toy_model_dir, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    said = f"--model {folder} has no tokenizer files (one of tokenizer.json, "
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(folder)  # (what the router loads it with)
    engine = tandem("engine", "--model", str(folder), "--port", "0")
    run_dir = tmp_path / "run"
    up = tandem("up", "--model", str(folder), "--run-dir", str(run_dir), "--rm-type", "boxed")
    for result in (engine, up):
        assert result.returncode == 2 and said in result.stderr, result.stderr[-2000:]
    assert not run_dir.exists()  # (refused before anything started)
    # a file, but not one the tokenizer reads: this one fails to load, a Qwen2 one is empty
    (folder / "vocab.txt").write_text("a\n")
    with pytest.raises(ValueError, match="weights_only: its tokenizer cannot be read"):
        load_tokenizer(folder)
    qwen2 = tmp_path / "qwen2"
    qwen2.mkdir()
    (qwen2 / "config.json").write_text('{"model_type": "qwen2"}')
    (qwen2 / "vocab.txt").write_text("a\n")
    with pytest.raises(ValueError, match=r"tokenizer \(Qwen2Tokenizer\) has no vocabulary"):
        load_tokenizer(qwen2)


def test_a_tokenizer_json_folder_is_read_as_autotokenizer_reads_it_without_importing_torch(
    toy_model_dir: Path,
) -> None:
    """AutoTokenizer reads the model's config to choose its class, importing the config's
    module and torch with it: ~3 s of CPU at each router start, for the class that
    tokenizer_config.json names already."""
    script = (
        "import sys; from services.common.tokenizers import load_tokenizer; "
        f"t = load_tokenizer({str(toy_model_dir)!r}); "
        "print(type(t).__name__, t('12>34').input_ids, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(toy_model_dir)
    ids = auto("12>34").input_ids
    assert done.stdout.split(" ", 1) == [type(auto).__name__, f"{ids} False\n"]


def test_a_router_waiting_for_its_engines_says_so_until_its_bound(redis_server: Any) -> None:
    """It waited --engine-wait-timeout-s (300 s) without a word."""
    result = tandem(
        "router",
        *("--engine-urls", "http://127.0.0.1:1", "--redis-url", redis_server.url),
        *("--run-id", "router-waits", "--engine-wait-timeout-s", "8", "--no-rollout"),
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "waiting for engine http://127.0.0.1:1 to answer GET /model_info (" in result.stderr
    assert "did not answer GET /model_info within 8s" in result.stderr


def test_a_router_given_a_server_that_is_no_engine_says_so_at_once(redis_server: Any) -> None:
    """A URL that answers 404 (another service on that port) was waited for 300 s."""
    from http.server import SimpleHTTPRequestHandler

    with serving(SimpleHTTPRequestHandler) as url:
        result = tandem(
            "router",
            *("--engine-urls", url, "--redis-url", redis_server.url, "--run-id", "router-404"),
            *("--engine-wait-timeout-s", "300", "--no-rollout"),
        )
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"{url} answers GET /model_info with HTTP 404: no SGLang server" in result.stderr


def test_a_reference_model_of_another_tokenizer_is_refused(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    """Its KL scored token ids that stand for other text (kl_ref 8.4 a step, silently)."""
    import json
    import shutil

    other = shutil.copytree(toy_model_dir, tmp_path / "other")
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]  # two digits' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    bare = shutil.copytree(toy_model_dir, tmp_path / "bare")  # no tokenizer files: vocab_size
    (bare / "tokenizer.json").unlink()
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "vocab_size": 8}))
    for ref, said in [
        (other, "its tokenizer is not --model's"),
        (bare, "its vocab_size is 8, fewer than --model's 16"),
    ]:
        flags = ["--kl-coef", "0.1", "--ref-load", str(ref), "--redis-url", "redis://127.0.0.1:1/0"]
        result = tandem("trainer", "--model", str(toy_model_dir), *flags)
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"--ref-load {ref}: {said}" in result.stderr, result.stderr[-2000:]


def into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """`tandem ARGS` whose standard output's reader has left before it writes (`| head`, every
    time: the race of a real `head` made these tracebacks come now and then)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "tandem.cli", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)


def test_a_reader_that_leaves_early_ends_each_printing_command_quietly_with_its_own_exit_code(
    buffer: Any,
) -> None:
    """`tandem ledger RUN | head -1` ended in a BrokenPipeError traceback and exit code 1 (the
    code of an unbalanced ledger), and so did `tandem config show`, `tandem --help` and
    `tandem timeline`."""
    buffer.incr_counter("groups_generated")
    where = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    for args, code in (
        (["ledger", *where], 1),  # one group generated and accounted for nowhere: unbalanced
        (["ledger", *where, "--json"], 1),
        (["config", "show"], 0),
        (["config", "reference"], 0),
        (["--help"], 0),
        (["up", "--help"], 0),
    ):
        done = into_a_closed_pipe(*args)
        assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
        assert done.returncode == code, (args, done.returncode, done.stderr[-2000:])
    buffer.incr_counter("groups_put")
    buffer.incr_counter("groups_consumed")
    buffer.record_trained(1, ["g"])
    done = into_a_closed_pipe("ledger", *where)
    assert done.returncode == 0 and not done.stderr, done.stderr


def test_a_service_process_leaves_as_pythons_exit_would_its_threads_joined_and_atexit_run(
    tmp_path: Path,
) -> None:
    """A service's process skips the interpreter's module teardown at exit (`leave`), but not
    what Python's exit does before it: a thread still working is waited for, the atexit
    handlers run (logging's flush among them), the exit code is the service's."""
    done = tmp_path / "done"
    script = (
        "import atexit, threading, time\n"
        "from tandem.cli import leave\n"
        "def work():\n"
        "    time.sleep(0.5)\n"
        f"    open({str(done)!r}, 'w').write('joined')\n"
        "threading.Thread(target=work).start()\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "print('buffered, not flushed', end='')\n"
        "leave(3)\n"
        "print('after leave')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout == "buffered, not flushedatexit ran\n"
    assert done.read_text() == "joined"
