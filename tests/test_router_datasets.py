"""Rollout inputs and scoring through the router process: datasets, chat template, rewards,
dynamic sampling and partial rollout (fake engines, real Valkey)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from proto import SampleGroup
from services.sample_buffer import SampleBuffer
from tests.helpers import (
    JsonHandler,
    read_all,
    router_args,
    serving,
    wait_until,
    with_chat_template,
)

CHAT_TEMPLATE = (
    "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model_dir(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy model with a chat template that renders `12` as `<bos>12>`."""
    return with_chat_template(
        toy_model_dir, tmp_path_factory.mktemp("chat") / "model", CHAT_TEMPLATE
    )


def metric(buffer: SampleBuffer, key: str) -> tuple[int, dict] | None:
    for _id, record in buffer.read_metrics():
        if key in record.values:
            return record.step, record.values
    return None


def test_jsonl_chat_prompts_use_the_chat_template_and_exact_match_rewards(
    buffer, chat_model_dir, start_service, engines, tmp_path
):
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}{b}"}], "label": f"{b}{a}"}
        for a in range(3)
        for b in range(3)
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows))
    # Held-out prompts that are not training prompts: evaluation scores these four.
    held = [
        {"prompt": [{"role": "user", "content": f"{a}{b}"}], "label": f"{b}{a}"}
        for a in (5, 6)
        for b in (7, 8)
    ]
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in held))
    args = router_args(
        buffer,
        chat_model_dir,
        [engines().url],
        "--prompt-data",
        str(train),
        "--eval-prompt-data",
        str(tmp_path / "eval.jsonl"),
        "--rm-type",
        "exact_match",
    )
    router = start_service("router", args)
    assert router.info["eval_task"] == (
        f"train: 4 prompts of {tmp_path / 'eval.jsonl'}, greedy, reward >= 1"
    )
    assert router.info["task_notes"] == []  # every row has its label
    assert router.info["longest_prompt"] == 4  # `<bos>12>` (tandem up checks samples fit)
    wait_until(lambda: buffer.depth() >= 4, "a batch")
    for group in read_all(buffer):
        a, b = json.loads(group.prompt)[0]["content"]
        assert group.samples[0].prompt_ids == [1, 4 + int(a), 4 + int(b), 14]
        assert [s.reward for s in group.samples] == [1.0, 0.0]
    _step, values = wait_until(lambda: metric(buffer, "eval/accuracy"), "eval")
    assert values["eval/accuracy"] == 1.0 and values["eval/num_prompts"] == 4


def test_parquet_text_prompts_with_the_last_number_verifier(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": ["12>", "34>", "56>", "78>"], "answer": [21, 43, 65, 87]})
    pq.write_table(table, tmp_path / "train.parquet")
    args = router_args(
        buffer,
        toy_model_dir,
        [engines().url],
        "--prompt-data",
        str(tmp_path / "train.parquet"),
        "--input-key",
        "question",
        "--label-key",
        "answer",
        "--rm-type",
        "last_number",
    )
    start_service("router", args)
    wait_until(lambda: buffer.depth() >= 4, "a batch")
    groups = read_all(buffer)
    assert {g.label for g in groups} <= {"21", "43", "65", "87"}
    assert all([s.reward for s in g.samples] == [1.0, 0.0] for g in groups)


@pytest.mark.slow
def test_prompts_that_fill_the_context_are_left_out_at_start_and_said_so(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    """The toy model has 64 positions: a 71-token prompt leaves no room for a response (the
    engine would answer 400 at every draw of it, and the loop back off as if the engines were
    down). It is left out when the data is read, with a note; a file of only such prompts
    fails the start, naming it."""
    rows = [{"prompt": "12>", "label": "21"}, {"prompt": "1" * 69 + ">", "label": "1"}]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    args = router_args(buffer, toy_model_dir, [engines().url], "--rm-type", "exact_match")
    router = start_service("router", [*args, "--prompt-data", str(data)])
    assert router.info["task_notes"] == [
        f"1 of 2 rows of {data} have prompts of at least 64 tokens, the model's context "
        "(max_position_embeddings; the first: row 2, 71 tokens): no response fits after "
        "them: left out (shorten them, or train a model with a longer context)"
    ]
    wait_until(lambda: buffer.depth() >= 4, "a batch")
    assert {g.prompt for g in read_all(buffer)} == {"12>"}
    assert buffer.drop_counts() == {}
    status = httpx.get(router.url + "/rollout/status").json()
    assert status["state"] != "backing_off", status
    router.stop()
    data.write_text(json.dumps(rows[0]) + "\n5")  # (tandem up's look reads the first row only)
    with pytest.raises(RuntimeError, match=r"train.jsonl: row 2 has no 'prompt' .*: it has int"):
        start_service("router", [*args, "--prompt-data", str(data)])
    data.write_text(json.dumps(rows[1]))
    with pytest.raises(RuntimeError, match=r"train.jsonl: every row has prompts of at least 64"):
        start_service("router", [*args, "--prompt-data", str(data)])


def test_a_bad_dataset_row_fails_startup_naming_the_file(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "12>", "label": "21"}\n{not json\n')
    args = router_args(buffer, toy_model_dir, [engines().url], "--prompt-data", str(bad))
    with pytest.raises(RuntimeError, match=r"bad.jsonl:2: not JSON"):
        start_service("router", [*args, "--rm-type", "exact_match"])
    # a dataset without a reward: the default verifier is the toy task's (exit 2, at once)
    with pytest.raises(RuntimeError, match=r"choose how its responses are scored: --rm-type"):
        start_service("router", args)


REWARD_MODULE = '''
def only_high_labels(text, label, stopped):
    """Constant reward for labels starting with 0-4: such groups carry no signal."""
    return 0.5 if label[0] in "01234" else float(stopped and text == label)
'''


def test_dynamic_sampling_drops_equal_reward_groups_and_the_gate_replaces_them(
    buffer, toy_model_dir, start_service, engines, tmp_path, monkeypatch
):
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    args = router_args(
        buffer,
        toy_model_dir,
        [engines().url, engines().url],
        "--custom-rm-path",
        "my_rewards:only_high_labels",
        "--dynamic-sampling",
        "--max-staleness",
        "0",
    )
    router = start_service("router", args)

    def rollout_done() -> bool:
        # The gate closes as the 4th group starts; a drop reopens it, and until the loop's next
        # reading the state still says waiting with nothing in flight: wait for the 4th put too.
        status = httpx.get(router.url + "/rollout/status").json()
        closed = status["state"] == "waiting_for_trainer" and status["groups_in_flight"] == 0
        return closed and buffer.depth() >= 4

    wait_until(rollout_done, "rollout 0 done")
    groups = read_all(buffer)
    assert len(groups) == 4, "exactly rollout_batch_size groups for rollout 0"
    assert all(len({s.reward for s in g.samples}) == 2 for g in groups)
    drops = buffer.drop_counts()
    assert set(drops) == {"all_rewards_equal"}
    _step, values = metric(buffer, "rollout/groups")
    assert values["rollout/groups"] == 4
    assert values["rollout/prompts_generated"] == 4 + drops["all_rewards_equal"], (
        "every prompt drawn is put or counted as a drop"
    )
    assert buffer.counters()["prompts_drawn"] == 4 + drops["all_rewards_equal"]


class RewardHandler(JsonHandler):
    fail = False
    calls = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server names it
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.fail:
            self.send_response(500)
            self.end_headers()
            return
        reward = 1.0 if body["response"] == body["label"] else 0.25
        self.send_json(200, {"reward": reward})


@pytest.fixture
def reward_server() -> Iterator[Callable[[bool], str]]:
    with ExitStack() as servers:

        def _start(fail: bool) -> str:
            handler = type("Handler", (RewardHandler,), {"fail": fail, "calls": 0})
            return servers.enter_context(serving(handler)) + "/score"

        yield _start


def test_a_remote_reward_service_scores_samples(
    buffer, toy_model_dir, start_service, engines, reward_server
):
    url = reward_server(False)
    start_service("router", router_args(buffer, toy_model_dir, [engines().url], "--rm-url", url))
    wait_until(lambda: buffer.depth() >= 4, "a batch")
    assert all([s.reward for s in g.samples] == [1.0, 0.25] for g in read_all(buffer))


def test_a_failing_reward_service_drops_groups_as_reward_errors(
    buffer, toy_model_dir, start_service, engines, reward_server
):
    url = reward_server(True)
    args = router_args(
        buffer,
        toy_model_dir,
        [engines().url],
        "--rm-url",
        url,
        "--rm-retries",
        "1",
        "--rm-timeout-s",
        "2",
    )
    start_service("router", args)
    wait_until(lambda: buffer.drop_counts().get("reward_error", 0) >= 4, "reward drops")
    assert buffer.depth() == 0
    assert any(url in d.detail for d in buffer.drop_log(10))


def first_two_groups(buffer: SampleBuffer) -> list[SampleGroup]:
    """Groups p0 and p1, the two in flight when the test aborted them (later groups, started
    on the new weights once the engines report them, may be put before either)."""
    found: list[SampleGroup] = []

    def both() -> bool:
        found.extend(g for g in read_all(buffer) if g.group_id in ("p0", "p1"))
        return len(found) == 2

    wait_until(both, "groups p0 and p1")
    return found


def test_partial_rollout_continues_aborted_samples_and_keeps_token_versions(
    buffer, toy_model_dir, start_service, engines
):
    urls = [engines("--token-delay-ms", "300").url, engines("--token-delay-ms", "300").url]
    args = router_args(
        buffer,
        toy_model_dir,
        urls,
        "--partial-rollout",
        "--max-staleness",
        "0",
        "--rollout-batch-size",
        "2",
        "--eval-interval",
        "0",
    )
    router = start_service("router", args)
    wait_until(
        lambda: httpx.get(router.url + "/rollout/status").json()["in_flight"] == 2,
        "batch 0 in flight",
    )
    httpx.post(router.url + "/pause_generation", json={"mode": "abort"})
    for url in urls:
        httpx.post(
            url + "/update_weights_from_disk", json={"model_path": "/m", "weight_version": "1"}
        )
    httpx.post(router.url + "/continue_generation", json={})
    groups = first_two_groups(buffer)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 4
    for s in samples:
        assert s.finish_reason != "abort"
        assert len(s.token_versions) == len(s.response_ids) == len(s.response_logprobs)
        assert s.token_versions[0] == 0 and s.token_versions[-1] == 1, "old prefix, new suffix"
        assert s.token_versions == sorted(s.token_versions)
        assert s.weight_version == 0, "a sample is as old as its oldest token"
    assert all(g.weight_version == 0 for g in groups)
    assert buffer.drop_counts() == {}


def test_without_partial_rollout_aborted_samples_restart_on_the_new_weights(
    buffer, toy_model_dir, start_service, engines
):
    urls = [engines("--token-delay-ms", "200").url]
    args = router_args(
        buffer,
        toy_model_dir,
        urls,
        "--max-staleness",
        "0",
        "--rollout-batch-size",
        "2",
        "--eval-interval",
        "0",
        response_len=16,  # (3.2 s a sample: none ends before the abort, on a loaded machine too)
    )
    router = start_service("router", args)
    wait_until(
        lambda: httpx.get(router.url + "/rollout/status").json()["in_flight"] == 2,
        "batch 0 in flight",
    )
    httpx.post(router.url + "/pause_generation", json={"mode": "abort"})
    httpx.post(
        urls[0] + "/update_weights_from_disk", json={"model_path": "/m", "weight_version": "1"}
    )
    httpx.post(router.url + "/continue_generation", json={})
    samples = [s for g in first_two_groups(buffer) for s in g.samples]
    assert len(samples) == 4
    assert all(set(s.token_versions) == {1} and s.weight_version == 1 for s in samples)
    assert all(s.finish_reason != "abort" for s in samples)
