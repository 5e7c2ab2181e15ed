"""`PATCH /rollout/config` changes outlive the router that took them.

Before, a router restarted on a running run (by hand, by `tandem up`'s restart, or by `tandem up
--resume`) started again from its flags: the PATCHes were lost without a word, and nothing
recorded them. Now each accepted PATCH is recorded in the run's Redis (the run's one record of
them) and a router started on the run re-applies them, saying so; a start given another value
for a PATCHed field wins over the PATCH, and says that. Real router processes, real Redis.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from proto.contract import SampleLimits
from services.rollout_router.config import patches_in_force, patches_key
from tandem.patches import said
from tests.helpers import wait_until
from tests.test_router_control import TOKEN, router_args
from tests.test_up_temperature import router_of, trainer_steps


def test_a_router_restarted_on_the_run_re_applies_its_patches_and_a_flag_given_then_wins(
    buffer, toy_model_dir, start_service, engines
) -> None:
    urls = [engines().url]
    first = start_service("router", router_args(buffer, toy_model_dir, urls))
    change = {"rollout_temperature": 0.7, "rollout_max_response_len": 2}
    assert httpx.patch(first.url + "/rollout/config", json=change, headers=TOKEN).is_success
    records = [json.loads(r) for r in buffer.redis.lrange(patches_key(buffer.config.run_id), 0, -1)]
    assert [(r["fields"], r["over"]) for r in records] == [
        (change, {"rollout_temperature": 1.0, "rollout_max_response_len": 4})
    ]
    assert records[0]["version"] == 0 and records[0]["time"] > 0
    first.stop()

    again = start_service("router_again", router_args(buffer, toy_model_dir, urls))
    config = httpx.get(again.url + "/rollout/config").json()
    assert (config["rollout_temperature"], config["rollout_max_response_len"]) == (0.7, 2)
    assert "re-applied the run's PATCHes of /rollout/config" in again.log()
    again.stop()

    hotter = router_args(buffer, toy_model_dir, urls, "--rollout-temperature", "0.9")
    flagged = start_service("router_flagged", hotter)
    config = httpx.get(flagged.url + "/rollout/config").json()
    assert (config["rollout_temperature"], config["rollout_max_response_len"]) == (0.9, 2)
    said = "rollout_temperature = 0.9 from this start's configuration wins over the run's PATCH"
    assert said in flagged.log()
    flagged.stop()
    records = [json.loads(r) for r in buffer.redis.lrange(patches_key(buffer.config.run_id), 0, -1)]
    assert [(r.get("by"), r["fields"]) for r in records] == [
        (None, change),
        ("re-applied", change),
        ("start", {"rollout_temperature": 0.9}),
        ("re-applied", {"rollout_max_response_len": 2}),
    ]


def test_a_patch_a_restarted_router_may_no_longer_apply_is_said_recorded_and_left_out(
    buffer, toy_model_dir, start_service, engines
) -> None:
    urls = [engines().url]
    first = start_service("router", router_args(buffer, toy_model_dir, urls))
    change = {"rollout_max_response_len": 12}
    assert httpx.patch(first.url + "/rollout/config", json=change, headers=TOKEN).is_success
    first.stop()
    buffer.set_limits(SampleLimits(max_tokens=64, max_response_len=8))  # a trainer since then
    again = start_service("router_again", router_args(buffer, toy_model_dir, urls))
    assert httpx.get(again.url + "/rollout/config").json()["rollout_max_response_len"] == 4
    assert "are refused now, not re-applied: rollout_max_response_len 12" in again.log()
    records = [json.loads(r) for r in buffer.redis.lrange(patches_key(buffer.config.run_id), 0, -1)]
    assert records[-1]["by"].startswith("refused: rollout_max_response_len 12: the trainer takes")
    assert records[-1]["fields"] == change
    assert said(records[-1]).startswith(
        "the router did not re-apply the run's PATCHes at step 0: rollout_max_response_len = 12: "
    )
    # the trainer's limits allow it again: the next start re-applies it
    buffer.set_limits(SampleLimits(max_tokens=64, max_response_len=16))
    again.stop()
    third = start_service("router_third", router_args(buffer, toy_model_dir, urls))
    assert httpx.get(third.url + "/rollout/config").json()["rollout_max_response_len"] == 12


def test_a_patch_holds_until_a_start_gives_its_field_another_value() -> None:
    patch = {"fields": {"rollout_temperature": 0.7}, "over": {"rollout_temperature": 1.0}}
    assert patches_in_force([patch], {"rollout_temperature": 1.0}) == (
        {"rollout_temperature": 0.7},
        {},
    )
    assert patches_in_force([patch], {"rollout_temperature": 0.9}) == (
        {},
        {"rollout_temperature": (0.7, 0.9)},
    )
    start = {"fields": {"rollout_temperature": 0.9}, "over": {"rollout_temperature": 0.9}}
    assert patches_in_force([patch, start], {"rollout_temperature": 0.9}) == ({}, {})


@pytest.mark.e2e
def test_tandem_up_says_each_patch_copies_it_to_the_run_folder_and_a_resume_re_applies_it(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    flags = ["--max-steps", "6", "--stop-accuracy", "0", "--seed", "5"]
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: len(trainer_steps(run_dir)) >= 2, "2 trainer steps", 300)
        url, token = router_of(run_dir)
        change = {"rollout_temperature": 0.8}
        patched = httpx.patch(url + "/rollout/config", json=change, headers=token, timeout=30)
        assert patched.status_code == 200, patched.text
        out, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out
    assert "PATCH /rollout/config at step " in out and "rollout_temperature = 0.8" in out, out
    copied = [json.loads(line) for line in (run_dir / "patches.jsonl").read_text().splitlines()]
    assert [r["fields"] for r in copied] == [change]

    resumed = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "up", "--resume", str(run_dir), "--max-steps", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    said = "the router re-applied the run's PATCHes /rollout/config at step"
    assert said in resumed.stdout and "rollout_temperature = 0.8" in resumed.stdout
    copied = [json.loads(line) for line in (run_dir / "patches.jsonl").read_text().splitlines()]
    assert [(r.get("by"), r["fields"]) for r in copied] == [
        (None, change),
        ("re-applied", change),
    ]
    # A resume that gives the PATCHed field a value of its own: that value wins, and is said.
    hotter = ["--max-steps", "10", "--rollout-temperature", "0.9"]
    flagged = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "up", "--resume", str(run_dir), *hotter],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert flagged.returncode == 0, flagged.stdout + flagged.stderr
    said = "with rollout_temperature = 0.9 (this launch's configuration): it wins over the run's"
    assert said in flagged.stdout, flagged.stdout
    assert "the router re-applied" not in flagged.stdout
