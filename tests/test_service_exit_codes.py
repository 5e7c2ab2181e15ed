"""Every service's exit code and message come from one table (`services.common.serving`):
2 = bad flags or configuration (a taken port included, named with its flag), 1 = a run-time
failure (exit 1 is checked where it happens: tests/test_trainer_never_silent.py, test_cli.py).
Each service is started as a real process; these all fail within start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.common.serving import bind_socket

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
            "--broker-retry-s must be > 0",
        ),
        "router buffer flag": (
            ["router", "--port", "0", *model, "--redis-call-timeout-s", "0"],
            "--redis-call-timeout-s must be > 0",
        ),
        "broker redis flag": (
            ["broker", "--port", "0", "--redis-call-timeout-s", "0"],
            "--redis-call-timeout-s must be > 0",
        ),
        "engine flag": (
            ["engine", *model, "--port", "0", "--max-batch-size", "0"],
            "--max-batch-size must be at least 1",
        ),
        "trainer flag": (
            ["trainer", *model, "--rollout-batch-size", "0"],
            "--rollout-batch-size must be >= 1",
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
