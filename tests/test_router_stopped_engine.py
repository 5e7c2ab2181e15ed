"""A stopped engine (SIGSTOP: a hung process or host) under a real router running its rollout
over two real reference engines and a real Valkey. The requests it holds are asked of the other
engine once it has answered nothing, neither them nor a probe, for `--stall-timeout-s`, not
after the health checks' count of failures (here never: `--health-failures 1000`); the rollout
goes on, every group it put is put once, and the ledger balances.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

import httpx

from services.sample_buffer import SampleBuffer
from tests.helpers import get_json, read_all, router_args, wait_until


def engine_args(toy_model_dir) -> list[str]:  # type: ignore[no-untyped-def]
    return ["engine", "--model", str(toy_model_dir), "--port", "0"]


def worker(router_url: str, url: str) -> dict:
    return {w["url"]: w for w in get_json(router_url + "/workers")["workers"]}[url]


def test_a_stopped_engines_requests_complete_on_the_other_and_the_ledger_balances(
    buffer: SampleBuffer, toy_model_dir, start_service
) -> None:
    engines = [start_service(f"engine{i}", engine_args(toy_model_dir)) for i in range(2)]
    victim = engines[1]
    # Never evicted by the health checks' count: only the stall watch can take it out.
    flags = ["--health-failures", "1000", "--max-staleness", "1000", "--eval-interval", "0"]
    urls = [e.url for e in engines]
    router = start_service("router", router_args(buffer, toy_model_dir, urls, *flags))
    wait_until(lambda: worker(router.url, victim.url)["requests"] > 0, "requests at the victim")
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        put_at_stop = get_json(router.url + "/rollout/status")["groups_put"]
        out = wait_until(
            lambda: (
                (w := worker(router.url, victim.url))["outstanding"] == 0 and not w["healthy"] and w
            ),
            "the stopped engine taken out, its requests sent to the other",
            timeout_s=20,
        )
        assert out["last_error"].startswith("stalled: answered none of its"), out["last_error"]
        # The rollout goes on on the other engine (the groups the stopped one held among them).
        wait_until(
            lambda: get_json(router.url + "/rollout/status")["groups_put"] >= put_at_stop + 8,
            "two more batches put after the stop",
            timeout_s=30,
        )
        assert worker(router.url, engines[0].url)["healthy"]
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    stopped = httpx.post(router.url + "/rollout/stop", timeout=30)
    assert stopped.status_code == 200, stopped.text
    ledger = wait_until(
        lambda: (led := buffer.ledger()).in_flight == 0 and led, "no group in flight", 30
    )
    assert ledger.balanced, ledger.sentence()
    assert "engine_error" not in ledger.dropped_groups, ledger.dropped_groups
    ids = Counter(g.group_id for g in read_all(buffer))
    assert sum(ids.values()) == ledger.put and max(ids.values()) == 1, "a group put twice"
