"""`tandem config show` prints the values the run uses and, with `--origin`, where each came from.

Before, it printed the stand-ins the run resolves later (`stop_accuracy = -1.0`,
`max_buffer_depth = -1`, `lr_decay_iters = 0`) and never where a value came from. Each test runs
the real CLI as a process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from tandem.up_tree import compose, render


def show(*flags: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "config", "show", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_config_show_prints_the_values_the_run_uses_with_the_stand_in_given_in_a_comment() -> None:
    text = show()
    for line in (
        "stop_accuracy = 0.9  # given -1: the toy model's default",
        "time_limit_s = 900.0  # given -1: the toy model's default",
        "stall_fail_s = 600.0  # given -1: the toy model's default",
        "max_buffer_depth = 256  # given -1: 4 batches",
        "lr_decay_iters = 300  # given 0: max_steps",
        "critic_lr = 0.001  # given 0: lr",
        "lr = 0.001",
        "context_length = 0  # the model's max_position_embeddings",
    ):
        assert line in text.splitlines(), line
    assert "stop_accuracy = -1.0" not in text and "max_buffer_depth = -1" not in text
    assert "rollout_max_response_len = 0  # the router's start sets it: 4 for the toy task" in text
    # every other value is the one the run folder's config.toml records
    shown, recorded = tomllib.loads(text), tomllib.loads(render(compose([]), {}))
    changed = {
        (table, key)
        for table, keys in shown.items()
        for key, value in keys.items()
        if recorded[table].get(key) != value
    }
    assert changed <= {
        ("up", "stop_accuracy"),
        ("up", "time_limit_s"),
        ("up", "startup_timeout_s"),
        ("up", "stall_fail_s"),
        ("router", "max_buffer_depth"),
        ("router", "rm_workers"),
        ("trainer", "lr_decay_iters"),
        ("trainer", "critic_lr"),
        ("router", "run_id"),
        ("router", "redis_url"),
    }, changed


def test_config_show_origin_says_where_each_value_came_from(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[router]\nrollout_temperature = 0.7\n[up]\nstop_accuracy = 0.5\n")
    env = {"TANDEM_TRAINER_ENTROPY_COEF": "0.01"}
    text = show("--origin", "--config", str(config), "--lr", "5e-4", env=env).splitlines()
    for line in (
        f"rollout_temperature = 0.7  # from {config} [router] rollout_temperature",
        f"stop_accuracy = 0.5  # from {config} [up] stop_accuracy",
        "entropy_coef = 0.01  # from TANDEM_TRAINER_ENTROPY_COEF",
        "lr = 0.0005  # from --trainer.lr (or --lr)",
        "max_steps = 300  # tandem up's default",
        "rollout_top_p = 1.0  # default",
        "time_limit_s = 900.0  # given -1: the toy model's default; default",
    ):
        assert line in text, line
