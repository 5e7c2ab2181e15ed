"""Run terms guarded wherever a service starts, not only by `tandem up --resume`: a router
started alone (as compose or a multi-host run starts it) on a running run must match the run's
prompt order. Real Valkey server, real router processes, stand-in engines at the far edge."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import wait_until
from tests.test_router_rollout import router_args


def test_a_router_restarted_with_another_seed_on_a_running_run_exits_2_naming_the_flag(
    buffer, toy_model_dir, start_service, engines
) -> None:
    urls = [engines().url]
    first = start_service("router", router_args(buffer, toy_model_dir, urls, "--seed", "7"))
    wait_until(lambda: buffer.depth() >= 4, "the first router's groups")
    first.stop()
    args = router_args(buffer, toy_model_dir, urls, "--seed", "8")
    again = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 2, again.stdout + again.stderr
    line = again.stderr.strip().splitlines()[-1]
    assert "seed is 7" in line and "set by the router" in line and "started with 8" in line
    assert "--seed" in line
    # The run's own seed is taken again.
    start_service("router", router_args(buffer, toy_model_dir, urls, "--seed", "7"))


def test_a_router_restarted_on_other_prompts_on_a_running_run_exits_2_naming_prompt_data(
    buffer, toy_model_dir, start_service, engines, tmp_path
) -> None:
    """The training prompts are a run term (`data`): the same file again is taken, another one
    (or the file changed) is refused with exit 2 naming --prompt-data; before, the router went
    on drawing from the run's cursor in the new prompts' order with a note."""
    first, other = tmp_path / "first.jsonl", tmp_path / "other.jsonl"
    first.write_text("\n".join(json.dumps({"prompt": f"{a}2>", "label": f"2{a}"}) for a in "123"))
    other.write_text(json.dumps({"prompt": "45>", "label": "54"}))
    args = router_args(buffer, toy_model_dir, [engines().url], "--rm-type", "exact_match")
    for _ in range(2):  # (the same prompts twice: taken)
        router = start_service("router", [*args, "--prompt-data", str(first)])
        wait_until(lambda: buffer.counters().get("prompts_drawn", 0) > 0, "a draw")
        router.stop()
    again = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args, "--prompt-data", str(other)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2, again.stdout + again.stderr
    line = again.stderr.strip().splitlines()[-1]
    assert "data is '2 prompts, sha256 " in line and "set by the router" in line, line
    assert "started with '1 prompts, sha256 " in line and "--prompt-data" in line, line
