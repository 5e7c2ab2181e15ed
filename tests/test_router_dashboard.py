"""The router's dashboard in a headless Chromium: a real router against a real reference engine
and Valkey, a consumer playing the trainer (reads groups, publishes `trainer` metrics records).
The page must show the worker with its weight version (and follow an update), the rollout
state, curves that grow with the run, the recent samples, and its pause and resume buttons
must pause and resume the real loop with the pasted token.

Set UPDATE_DOCS=1 to write the screenshot to docs/dashboard.png (the README shows it); else it
goes to the test's temporary folder, so that a test run leaves the working tree clean.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from services.sample_buffer import SampleBuffer
from tandem.supervisor import die_with_parent
from tests.browser import Browser, chromium_binary
from tests.helpers import free_port, router_args, wait_until

TOKEN = "dash-t0ken"
DOCS_PNG = Path(__file__).resolve().parent.parent / "docs" / "dashboard.png"


def play_trainer(buffer: SampleBuffer, stop: threading.Event) -> None:
    """Consume groups 4 at a time and publish one `trainer` record per 'step', as the trainer
    does (reward, staleness, samples, step time); count them consumed for the demand gate."""
    buffer.ensure_consumer_group()
    step, version = 0, 0
    while not stop.is_set():
        read = buffer.read_groups("dashboard-trainer", 4, block_ms=200)
        if not read:
            continue
        samples = [s for _id, g in read for s in g.samples]
        version = max(version, *(g.weight_version for _id, g in read))  # the trainer's weights
        ages = [version - g.weight_version for _id, g in read]
        buffer.ack([i for i, _g in read])
        buffer.incr_counter("groups_consumed", len(read))
        step += 1
        buffer.publish_metrics(
            "trainer",
            step,
            {
                "train/reward_mean": sum(s.reward for s in samples) / len(samples),
                "train/staleness_mean": sum(ages) / len(ages),
                "train/staleness_max": float(max(ages)),
                "train/samples": float(len(samples)),
                "train/step_time_s": 0.05,
                # a NaN must not break the metrics route (nor the loss chart)
                "train/loss": float("nan") if step == 1 else 1.0 / step,
                "train/grad_norm": 2.0 / step,
                "train/entropy": 1.0 + 1.0 / step,
                "train/approx_kl": 0.01 * step,
                "train/logprob_abs_diff_max": float("nan") if step % 2 else 1e-3,
                "train/mismatch_kl": 1e-4,
            },
        )
        stop.wait(0.1)


JS_WORKER = "document.querySelector('#workers tr[data-worker] .version')?.textContent"
JS_POINTS = "Number(document.getElementById('chart-{}').dataset.points || 0)"
JS_STATE = "document.getElementById('state').textContent"
JS_WAITING = "document.getElementById('waiting').textContent"


@pytest.mark.slow
def test_the_dashboard_shows_workers_state_curves_and_samples_and_pauses_the_loop(
    buffer, toy_model_dir, start_service, tmp_path
):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install -y chromium)")
    # The engine and the browser start while the router starts (it waits for the engine).
    engine_url = f"http://127.0.0.1:{free_port()}"
    engine = start_engine(toy_model_dir, engine_url, tmp_path)
    browser = Browser(binary, tmp_path)
    flags = ["--api-token", TOKEN, "--max-staleness", "1000", "--version-poll-s", "0.2"]
    flags += ["--rollout-max-concurrency", "2"]  # enough groups to watch; CPU left for the rest
    try:
        router = start_service("router", router_args(buffer, toy_model_dir, [engine_url], *flags))
        browser.connect()
        run_the_dashboard(browser, router.url, engine_url, toy_model_dir, buffer, tmp_path)
    finally:
        browser.close()
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()


def start_engine(model: Path, url: str, workdir: Path) -> subprocess.Popen:
    """`tandem engine` on `url`'s port, not waited for (the router waits for it to answer)."""
    port = url.rsplit(":", 1)[1]
    with open(workdir / "engine.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "engine", "--model", str(model), "--port", port],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def run_the_dashboard(
    browser: Browser, url: str, engine_url: str, model: Path, buffer: SampleBuffer, tmp_path: Path
) -> None:
    """The page against the running router, with a consumer playing the trainer."""
    stop = threading.Event()
    trainer = threading.Thread(target=play_trainer, args=(buffer, stop), daemon=True)
    trainer.start()
    try:
        browser.open(url + "/")
        worker = wait_until(lambda: browser.evaluate(JS_WORKER), "the worker row", 20)
        assert worker == "0", "the engine serves version 0 (--model)"
        for chart in ("reward", "throughput", "staleness", "loss", "grad_norm", "entropy"):
            wait_until(lambda c=chart: browser.evaluate(JS_POINTS.format(c)) >= 2, chart, 20)
        for chart in ("kl", "mismatch"):  # (the trainer's health, beside the rollout's)
            wait_until(lambda c=chart: browser.evaluate(JS_POINTS.format(c)) >= 2, chart, 20)
        # The start-up evaluation runs beside the rollouts, once the engine is admitted.
        wait_until(
            lambda: browser.evaluate(JS_POINTS.format("accuracy")) >= 1, "the start-up eval", 20
        )
        wait_until(
            lambda: browser.evaluate("document.querySelectorAll('#samples pre').length") > 0,
            "recent samples",
        )
        states = {"generating", "waiting_for_buffer"}
        try:  # (one status poll may fail on a loaded machine: the next one shows it)
            wait_until(lambda: browser.evaluate(JS_STATE) in states, "the rollout state", 20)
        except AssertionError as exc:
            banner = browser.evaluate("document.getElementById('banner').textContent")
            raise AssertionError(f"{browser.evaluate(JS_STATE)!r}; banner: {banner!r}") from exc

        # A new weight version on the engine shows in the workers table.
        httpx.post(
            engine_url + "/update_weights_from_disk",
            json={"model_path": str(model), "weight_version": "1"},
            timeout=30,
        ).raise_for_status()
        wait_until(lambda: browser.evaluate(JS_WORKER) == "1", "version 1 on the page", 20)
        browser.screenshot(tmp_path / "dashboard.png")
        if os.environ.get("UPDATE_DOCS") == "1":
            browser.screenshot(DOCS_PNG)

        # Pause without the token: refused and said so; with it: the loop pauses and resumes.
        browser.evaluate("document.getElementById('pause').click()")
        wait_until(
            lambda: "401" in browser.evaluate("document.getElementById('control-msg').textContent"),
            "401 message",
            10,
        )
        assert httpx.get(url + "/rollout/status").json()["paused"] is False
        browser.evaluate(f"document.getElementById('token').value = '{TOKEN}'")
        browser.evaluate("document.getElementById('pause').click()")
        wait_until(lambda: browser.evaluate(JS_STATE) == "paused", "'paused' on the page", 20)
        status = httpx.get(url + "/rollout/status").json()
        assert status["state"] == "paused"
        waiting = "waiting for POST /rollout/resume (the loop was paused on request)"
        wait_until(lambda: browser.evaluate(JS_WAITING) == waiting, "why it waits", 20)
        # while no group is put, the status's note says what was dropped instead, and why
        note = "3 groups dropped since the last one put (env_error 3; the last: HTTP 500)"
        shown = f"showStatus({json.dumps({**status, 'note': note})}); {JS_WAITING}"
        assert browser.evaluate(shown) == f"{waiting}; {note}"
        # a loop that waits for nothing says where its groups are
        busy = "64 groups in flight: 0 requests at the engines; 512 calls to reward function f"
        running = {**status, "state": "generating", "waiting_for": "", "busy": busy}
        assert browser.evaluate(f"showStatus({json.dumps(running)}); {JS_WAITING}") == (
            f"busy with {busy}"
        )
        browser.evaluate("document.getElementById('resume').click()")
        wait_until(lambda: browser.evaluate(JS_STATE) != "paused", "resumed on the page", 20)
        # the pause and the resume are marked on the trainer's curves (control/* records)
        marks = (
            "[...document.querySelectorAll('#chart-loss line[data-mark]')].map(m => m.dataset.mark)"
        )
        wait_until(lambda: browser.evaluate(marks) == ["pause", "resume"], "the marks", 20)
        browser.screenshot(tmp_path / "dashboard-marks.png")
        assert browser.evaluate("document.getElementById('banner').textContent") == ""
        check_routes(url)
    finally:
        stop.set()
        trainer.join(timeout=5)


def check_routes(url: str) -> None:
    """The metrics route pages through the stream in order; bad input is a 4xx."""
    pages, after = [], "0"
    while not pages or (pages[-1]["more"] and len(pages) < 4):
        pages.append(
            httpx.get(url + "/rollout/metrics", params={"after": after, "limit": 3}).json()
        )
        after = pages[-1]["last_id"]
    ids = [r["id"] for page in pages for r in page["records"]]
    assert all(len(page["records"]) <= 3 for page in pages) and len(ids) > 3
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    assert len(set(ids)) == len(ids)
    assert {r["source"] for page in pages for r in page["records"]} <= {"router", "trainer"}
    only = httpx.get(url + "/rollout/metrics", params={"keys": "train/staleness_max"}).json()
    assert only["records"] and all(
        r["values"].keys() == {"train/staleness_max"} for r in only["records"]
    )
    assert httpx.get(url + "/rollout/metrics", params={"after": "$"}).status_code == 422
    assert httpx.get(url + "/rollout/samples", params={"limit": 0}).status_code == 422
    assert httpx.get(url + "/static/nothing.js").status_code == 404
