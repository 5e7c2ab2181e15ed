"""Every service's exit code and message come from one table (`services.common.serving`):
2 = bad flags or configuration (a taken port included, named with its flag), 1 = a run-time
failure (exit 1 is checked where it happens: tests/test_trainer_never_silent.py, test_cli.py).
Each service is started as a real process; these all fail within start-up. Numbers every
command refuses the same way (nan, a time or a count below 0) are checked on the parsers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.serving import bind_socket
from services.common.settings import load, parser
from services.rollout_router.config import RouterConfig
from services.trainer.config import TrainerConfig
from tandem import launcher
from tests.test_config import toml_file

ENV = {k: v for k, v in os.environ.items() if k not in {"TANDEM_API_TOKEN", "TANDEM_WEIGHT_SECRET"}}


def start_all(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Run every command at once (each fails fast) and collect the results."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for name, argv in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def test_bad_flags_and_a_taken_port_exit_2_with_one_line_naming_the_flag(
    toy_model_dir: Path,
) -> None:
    taken = bind_socket("127.0.0.1", 0)
    taken.listen()
    port = str(taken.getsockname()[1])
    model = ["--model", str(toy_model_dir)]
    public_rendezvous = [
        *model,
        "--weight-transport",
        "nccl",
        "--weights-endpoint",
        "tcp://127.0.0.1:1",
        "--weights-master-address",
        "10.1.2.3",
    ]
    expected = {  # name: (argv, words the last stderr line must hold)
        "broker flag": (["broker", "--port", "0", "--transport", "disk"], "--disk-dir"),
        "router flag": (["router", "--port", "0", "--host", "0.0.0.0"], "TANDEM_API_TOKEN"),
        "router pool flag": (
            ["router", "--port", "0", *model, "--broker-retry-s", "0"],
            "--broker-retry-s 0: must be more than 0",
        ),
        "router buffer flag": (
            ["router", "--port", "0", *model, "--redis-call-timeout-s", "0"],
            "--redis-call-timeout-s 0: must be more than 0",
        ),
        "broker redis flag": (
            ["broker", "--port", "0", "--redis-call-timeout-s", "0"],
            "--redis-call-timeout-s 0: must be more than 0",
        ),
        # (0 s was no bound: a hung engine held every sync up for good)
        "broker sync flag": (
            ["broker", "--port", "0", "--sync-timeout-s", "0"],
            "--sync-timeout-s 0: must be more than 0",
        ),
        "broker versions flag": (
            ["broker", "--port", "0", "--keep-versions", "0"],
            "--keep-versions 0: must be at least 1",
        ),
        "engine flag": (
            ["engine", *model, "--port", "0", "--max-batch-size", "0"],
            "--max-batch-size 0: must be at least 1",
        ),
        "trainer flag": (
            ["trainer", *model, "--rollout-batch-size", "0"],
            "--rollout-batch-size 0: must be at least 1",
        ),
        "trainer rendezvous": (["trainer", *public_rendezvous], "TANDEM_WEIGHT_SECRET"),
        "broker port": (["broker", "--port", port], f"port {port} on 127.0.0.1"),
        "router port": (["router", "--port", port, *model], f"port {port} on 127.0.0.1"),
        "engine port": (["engine", *model, "--port", port], f"port {port} on 127.0.0.1"),
        # (the old code: OSError's traceback, exit 1)
        "broker host": (
            ["broker", "--port", "0", "--host", "192.0.2.1"],  # (TEST-NET-1: no host's)
            "cannot listen on 192.0.2.1 port 0 (Cannot assign requested address): --host must",
        ),
    }
    try:
        results = start_all({name: argv for name, (argv, _) in expected.items()})
    finally:
        taken.close()
    for name, (argv, words) in expected.items():
        result = results[name]
        assert result.returncode == 2, (name, result.stderr[-2000:])
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith(f"tandem {argv[0]}: ") and words in line, (name, line)
        if name.endswith("port"):
            assert "already in use; pick another with --port" in line, line
    assert "--weights-master-address 10.1.2.3" in results["trainer rendezvous"].stderr


def test_a_number_given_as_nan_or_inf_exits_2_naming_its_flag(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """float() takes "nan", and TOML has nan: a bound of nan bounded nothing (tandem up's
    --time-limit-s nan ran without a limit), a timeout of nan crashed a service later. A time
    in seconds below 0 is refused the same way (a request timeout of -3 s was taken). A value
    from the file or a variable is named as such."""
    path = toml_file(tmp_path, "[router]\nrm_timeout_s = nan\n")
    for argv, named in (
        (["--rm-timeout-s", "nan"], "--rm-timeout-s "),
        (["--config", str(path)], f"{path}: [router] rm_timeout_s = "),
        ([], "environment variable TANDEM_ROUTER_RM_TIMEOUT_S="),
    ):
        if not argv:  # a variable
            monkeypatch.setenv("TANDEM_ROUTER_RM_TIMEOUT_S", "nan")
        with pytest.raises(SystemExit) as exc:
            load(RouterConfig, argv, "router")
        assert exc.value.code == 2
        assert f"error: {named}nan: not a finite number" in capsys.readouterr().err, argv
    monkeypatch.delenv("TANDEM_ROUTER_RM_TIMEOUT_S")
    said = "--time-limit-s nan: not a finite number"
    assert launcher.parse(["--time-limit-s", "nan"])[1] == [said]
    for argv in (["--lr", "inf"], ["--stall-warn-s=-inf"]):  # (each was taken)
        said = f"{argv[0].split('=')[0]} {argv[-1].split('=')[-1]}: not a finite number"
        assert [p for p in launcher.parse(argv)[1] if p.endswith(said)], argv
    negative = toml_file(tmp_path, "[router]\nrequest_timeout_s = -3\n")
    with pytest.raises(SystemExit) as exc:
        load(RouterConfig, ["--config", str(negative)], "router")
    said = f"error: {negative}: [router] request_timeout_s = -3: must be at least 0"
    assert exc.value.code == 2 and said in capsys.readouterr().err
    assert load(RouterConfig, ["--request-timeout-s", "0"], "router")  # (0: its own rule)
    # an integer whose default is not negative: a count, a length, a port (-3 was taken)
    for argv, said in (
        (["--max-sessions", "-3"], "--max-sessions -3: must be at least 0"),
        (["--env-max-turns", "-1"], "--env-max-turns -1: must be at least 0"),
    ):
        with pytest.raises(SystemExit):
            load(RouterConfig, argv, "router")
        assert said in capsys.readouterr().err
    said = "trainer: --keep-last-checkpoints -1: must be at least 0"  # (its alias's setting)
    assert launcher.parse(["--keep-checkpoints", "-1"])[1] == [said]
    assert load(RouterConfig, ["--max-buffer-depth", "-1"], "router")  # (its default)
    # below 0 but a default below 0 (-1: the model's, all, none): each was taken for the default
    for parse, argv in (
        (lambda argv: load(RouterConfig, argv, "router"), ["--max-buffer-depth", "-3"]),
        (lambda argv: load(TrainerConfig, argv, "trainer"), ["--ckpt-step", "-3"]),
        (lambda argv: load(TrainerConfig, argv, "trainer"), ["--metrics-port", "-2"]),
    ):
        with pytest.raises(SystemExit) as exc:
            parse(argv)
        said = f"error: {' '.join(argv)}: must be at least -1"
        assert exc.value.code == 2 and said in capsys.readouterr().err, argv
    assert launcher.parse(["--time-limit-s", "-5"])[1] == ["--time-limit-s -5: must be at least -1"]


def test_a_learning_rate_out_of_range_exits_2_naming_the_flag_or_variable_it_came_from(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """tandem up --lr 1e9 was taken and trained on (RL post-training takes ~1e-6 to 1e-4), and
    a variable's nan was refused as `--lr nan`, a flag nobody typed: a learning rate is above 0
    and at most 1, and the refusal names the flag, the variable or the file's key."""
    toml = toml_file(tmp_path, "[trainer]\nlr = 5.0\n")
    cases = [
        (["--lr", "1e9"], {}, "trainer: --lr 1e9: must be at most 1"),
        (["--lr=-0.001"], {}, "trainer: --lr -0.001: must be more than 0"),
        ([], {"TANDEM_TRAINER_LR": "nan"}, "variable TANDEM_TRAINER_LR=nan: not a finite number"),
        ([], {"TANDEM_TRAINER_LR": "2"}, "variable TANDEM_TRAINER_LR=2: must be at most 1"),
        ([], {"TANDEM_TRAINER_LR": "-1"}, "variable TANDEM_TRAINER_LR=-1: must be more than 0"),
        (["--config", str(toml)], {}, "[trainer] lr = 5.0: must be at most 1"),
    ]
    for argv, env, said in cases:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        problems = launcher.parse(argv)[1]
        assert len(problems) == 1 and said in problems[0], (argv, problems)
        for name in env:
            monkeypatch.delenv(name)
    # a flag beats the variable: the value refused is the flag's, named as the flag
    monkeypatch.setenv("TANDEM_TRAINER_LR", "1e-4")
    assert launcher.parse(["--lr", "3"])[1] == ["trainer: --lr 3: must be at most 1"]
    tree, flag = launcher.parse([])[0], launcher.parse(["--lr", "1"])[0]
    assert tree is not None and flag is not None
    assert tree.value("trainer", "lr") == 1e-4 and flag.value("trainer", "lr") == 1
    # the trainer's own rates, run on its own (compose, a cluster's launcher)
    for argv in (["--lr", "10"], ["--critic-lr", "5"], ["--min-lr", "2"]):
        with pytest.raises(SystemExit) as exc:
            load(TrainerConfig, argv, "trainer")
        said = f"error: {' '.join(argv)}: must be at most 1"
        assert exc.value.code == 2 and said in capsys.readouterr().err, argv
    # and --help says the range of each, before anyone is refused
    flags = parser(TrainerConfig, "tandem trainer")  # (tandem up's --lr: the trainer's field)
    rates = [a for a in flags._actions if a.dest == "lr" or a.dest.endswith("_lr")]
    assert rates and all("0 to 1" in str(a.help) for a in rates), flags.prog
