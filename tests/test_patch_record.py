"""`PATCH /rollout/config` changes outlive the router that took them.

Before, a router restarted on a running run (by hand, by `tandem up`'s restart, or by `tandem up
--resume`) started again from its flags: the PATCHes were lost without a word, and nothing
recorded them. Now each accepted PATCH is recorded in the run's Redis (the run's one record of
them) and a router started on the run re-applies them, saying so; a start given another value
for a PATCHed field wins over the PATCH, and says that. Real router processes, real Redis.
"""

from __future__ import annotations

import json

import httpx

from services.rollout_router.config import patches_in_force, patches_key
from tests.test_router_control import TOKEN, router_args


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
    assert records[-1]["by"] == "start" and records[-1]["fields"] == {"rollout_temperature": 0.9}


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
