"""Pure logic of the router: worker choice, seeds, batches, sample building."""

from __future__ import annotations

import asyncio
import re

import pytest

from services.rollout_router.balancer.engine_context import ContextGate
from services.rollout_router.balancer.worker import Worker, rendezvous, worker_id_for
from services.rollout_router.balancer.workers import WorkerPool
from services.rollout_router.config import WorkerPoolConfig
from services.rollout_router.rollout.limiter import Limiter
from services.rollout_router.rollout.rewards import boxed, exact_match, last_number, load_function
from services.rollout_router.samples import Partial, sampling_seed


def pool_with(urls: list[str], policy: str = "least_outstanding") -> WorkerPool:
    pool = WorkerPool(WorkerPoolConfig(policy=policy))
    for url in urls:
        pool.workers[worker_id_for(url)] = Worker(url, worker_id_for(url))
    return pool


def test_least_outstanding_picks_the_idlest_worker_and_skips_excluded_ones():
    pool = pool_with(["http://a", "http://b", "http://c"])
    load = {"http://a": 3, "http://b": 1, "http://c": 2}
    for w in pool.workers.values():
        w.outstanding = load[w.url]
    assert pool.pick().url == "http://b"
    assert pool.pick({"http://b"}).url == "http://c"
    assert pool.pick({"http://a", "http://b", "http://c"}).url == "http://b", "all tried: reuse"


def test_least_outstanding_breaks_ties_in_turn():
    pool = pool_with(["http://a", "http://b", "http://c"])
    assert [pool.pick().url for _ in range(6)] == ["http://a", "http://b", "http://c"] * 2


def test_round_robin_cycles_through_healthy_workers_only():
    pool = pool_with(["http://a", "http://b", "http://c"], "round_robin")
    pool.workers[worker_id_for("http://b")].healthy = False
    assert [pool.pick().url for _ in range(4)] == ["http://a", "http://c"] * 2


def test_session_affinity_keeps_a_session_on_its_worker_and_moves_only_a_removed_workers_sessions():
    pool = pool_with([f"http://w{i}" for i in range(4)], "session_affinity")
    before = {s: pool.pick(session_id=s).url for s in map(str, range(200))}
    assert all(pool.pick(session_id=s).url == u for s, u in before.items())
    assert len(set(before.values())) == 4
    removed = "http://w2"
    pool.remove(removed)
    after = {s: pool.pick(session_id=s).url for s in before}
    moved = {s for s in before if before[s] != after[s]}
    assert moved == {s for s, u in before.items() if u == removed}


def test_rendezvous_is_deterministic():
    pool = pool_with(["http://a", "http://b"])
    workers = list(pool.workers.values())
    assert rendezvous(workers, "s1") is rendezvous(list(reversed(workers)), "s1")


def test_sampling_seeds_are_stable_and_distinct_per_prompt_and_batch():
    seeds = {sampling_seed(7, b, i) for b in range(10) for i in range(64)}
    assert len(seeds) == 640
    assert sampling_seed(7, 3, 5) == sampling_seed(7, 3, 5)
    assert all(0 <= s < 2**31 for s in seeds)


def output(ids: list[int], version: int, finish: str, text: str = "") -> dict:
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": finish},
            "weight_version": str(version),
            "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(ids)],
        },
    }


def test_a_sample_takes_tokens_and_logprobs_from_output_token_logprobs():
    s = Partial.of(output([6, 5, 2], 3, "stop", "21")).to_sample([1, 5, 6, 14], reward=1.0)
    assert s.prompt_ids == [1, 5, 6, 14]
    assert s.response_ids == [6, 5, 2]
    assert s.response_logprobs == [-0.5, -1.0, -1.5]
    assert s.loss_mask == [1, 1, 1]
    assert s.token_versions == [3, 3, 3]
    assert (s.weight_version, s.finish_reason, s.reward, s.response_text) == (3, "stop", 1.0, "21")


def test_a_continued_sample_keeps_each_tokens_weight_version_and_the_oldest_as_its_own():
    partial = Partial.of(output([6], 3, "abort", "2"))
    partial.extend(output([5, 2], 4, "stop", "1"))
    s = partial.to_sample([1], reward=0.5)
    assert s.response_ids == [6, 5, 2]
    assert s.token_versions == [3, 4, 4]
    assert s.weight_version == 3
    assert (s.finish_reason, s.response_text) == ("stop", "21")


def test_a_sample_carries_the_routing_of_its_latest_engine_output_in_compact_form():
    import base64
    import struct

    def routed(values: list[int]) -> str:
        return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()

    assert Partial.of(output([6], 3, "stop")).to_sample([1], reward=0.0).routed_experts == b""
    first = output([6], 3, "abort")
    first["meta_info"]["routed_experts"] = routed([0, 1])  # positions [0, 1): prompt token
    partial = Partial.of(first)
    later = output([5, 2], 4, "stop")  # continued from position 0 on newer weights
    later["meta_info"]["routed_experts"] = routed([2, 3, 1, 0, 3, 2])
    partial.extend(later)
    assert partial.to_sample([1], reward=0.5).routed_experts == bytes([2, 3, 1, 0, 3, 2])
    wide = output([6], 3, "stop")
    wide["meta_info"]["routed_experts"] = routed([300, 1])  # an index past 255: two bytes each
    assert Partial.of(wide).to_sample([1], reward=0.0).routed_experts == struct.pack("<2h", 300, 1)


def test_builtin_verifiers_judge_answers():
    from services.rollout_router.rollout.toy_task import reverse_digits_reward

    assert reverse_digits_reward("21", "21", True) == 1.0
    assert reverse_digits_reward("2", "21", False) == 1 / 3
    assert reverse_digits_reward("21", "2", True) == 2 / 3  # a short label: no error
    assert reverse_digits_reward("", "", False) == 0.0
    assert exact_match(" 42\n", "42", True) == 1.0
    assert exact_match("42.", "42", True) == 0.0
    assert last_number("so 3 apples and 1,200 pears", "1200", True) == 1.0
    assert last_number("it is 7 not 8", "7", True) == 0.0
    assert last_number("no digits", "7", True) == 0.0
    assert last_number("x = -2.50", "-2.5", True) == 1.0
    assert boxed("thus \\boxed{\\frac{1}{2}} and", "\\frac{1}{2}", True) == 1.0
    assert boxed("\\boxed{3} then \\boxed{ 4 }", "4", True) == 1.0
    assert boxed("\\boxed{4.0}", "4", True) == 1.0
    assert boxed("4", "4", True) == 0.0
    assert boxed("\\boxed{4", "4", True) == 0.0


def test_a_reward_function_loads_by_dotted_path_or_fails_naming_it():
    assert load_function("services.rollout_router.rollout.rewards:boxed") is boxed
    assert load_function("services.rollout_router.rollout.rewards.boxed") is boxed
    with pytest.raises(ValueError, match="no_such_module:f"):
        load_function("no_such_module:f")
    # a function Tandem cannot call with (response_text, label, stopped) fails the start
    with pytest.raises(ValueError) as error:
        load_function("tests.test_router_units:two_parameters")
    assert str(error.value) == (
        "--custom-rm-path 'tests.test_router_units:two_parameters': two_parameters(response, "
        "label) cannot be called as two_parameters(response_text, label, stopped) (too many "
        "positional arguments); give it those three parameters (docs/train-your-model.md)"
    )
    assert load_function("tests.test_router_units:with_defaults")("a", "b", True) == 1.0


def two_parameters(response, label):  # type: ignore[no-untyped-def]
    return 1.0


def with_defaults(response, label, stopped=True, *rest, **kwargs):  # type: ignore[no-untyped-def]
    return 1.0


async def test_the_limiter_admits_at_most_its_limit_and_can_be_raised_while_tasks_wait():
    limiter = Limiter(2)
    peak, release = 0, asyncio.Event()

    async def hold() -> None:
        nonlocal peak
        async with limiter:
            peak = max(peak, limiter.holders)
            await release.wait()

    tasks = [asyncio.create_task(hold()) for _ in range(5)]
    await asyncio.sleep(0.05)
    assert limiter.holders == 2
    limiter.set_limit(4)
    await asyncio.sleep(0.05)
    assert limiter.holders == 4
    release.set()
    await asyncio.gather(*tasks)
    assert peak == 4 and limiter.holders == 0


class NoEosTokenizer:
    eos_token_id = None


def test_startup_warns_when_nothing_would_stop_a_rollout(caplog):
    from services.rollout_router.app import stop_ids
    from services.rollout_router.config import SamplingConfig

    assert stop_ids(NoEosTokenizer(), SamplingConfig(rollout_stop_token_ids=[7])) == [7]
    assert "no end-of-sequence token" not in caplog.text
    assert stop_ids(NoEosTokenizer(), SamplingConfig()) == []
    assert "no end-of-sequence token" in caplog.text and "--rollout-stop" in caplog.text


def turn(prompt: list[int], ids: list[int], version: int = 0) -> tuple[list[int], Partial]:
    return prompt, Partial.of(output(ids, version, "stop"))


def test_session_turns_merge_by_exact_prefix_and_split_when_the_history_was_re_rendered():
    from services.rollout_router.gateway.session_store import Session, session_samples

    session = Session("s")
    for prompt, partial in [
        turn([1, 5, 14], [6, 2]),
        turn([1, 5, 14, 6, 2, 7, 14], [8, 2], version=1),  # extends turn 1: merged
        turn([1, 9, 14], [4, 2], version=1),  # history rendered differently: a new sample
    ]:
        session.record(prompt, partial)
    assert [t.prompt.tolist() for t in session.turns] == [[1, 5, 14], [7, 14], [1, 9, 14]], (
        "a turn that extends the context holds only the tokens beyond it"
    )
    first, second = session_samples(session, reward=0.5)
    assert first.prompt_ids == [1, 5, 14]
    assert first.response_ids == [6, 2, 7, 14, 8, 2]
    assert first.loss_mask == [1, 1, 0, 0, 1, 1]
    assert first.token_versions == [0, 0, 0, 0, 1, 1]
    assert first.response_logprobs == [-0.5, -1.0, 0.0, 0.0, -0.5, -1.0]
    assert (second.prompt_ids, second.response_ids, second.loss_mask) == (
        [1, 9, 14],
        [4, 2],
        [1, 1],
    )
    assert first.reward == second.reward == 0.5


def merged_as_lists(turns: list[tuple[list[int], Partial]], reward: float) -> list:
    """The merge as the router made it while it held each turn's whole prompt as a list."""
    from services.rollout_router.gateway.session_store import _finish

    samples, prompt, current, mask = [], [], None, []
    for prompt_ids, partial in turns:
        context = prompt + (current.ids if current else [])
        if current is not None and prompt_ids[: len(context)] == context:
            between = prompt_ids[len(context) :]
            last = current.token_versions[-1] if current.token_versions else -1
            current.ids += between
            current.logprobs += [0.0] * len(between)
            current.token_versions += [last] * len(between)
            mask += [0] * len(between)
            current.extend_partial(partial)
            mask += [1] * len(partial.ids)
            continue
        if current is not None:
            samples.append(_finish(current, prompt, mask, reward))
        prompt, mask = list(prompt_ids), [1] * len(partial.ids)
        current = Partial()
        current.extend_partial(partial)
    if current is not None:
        samples.append(_finish(current, prompt, mask, reward))
    return samples


def test_sessions_held_as_arrays_merge_exactly_as_whole_prompts_did():
    import random

    from proto.packed import pack_sample
    from services.rollout_router.gateway.session_store import Session, session_samples

    rng = random.Random(7)
    for case in range(200):
        session, turns, context = Session(f"s{case}"), [], []
        for version in range(rng.randrange(1, 8)):
            roll = rng.random()
            if not context or roll < 0.15:  # a first turn, or a history rendered anew
                prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
            elif roll < 0.25:  # a prompt cut short of the context: no merge
                prompt = context[: rng.randrange(len(context))]
            else:  # the context, then tool output or a user message (maybe none)
                prompt = context + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 4))]
            ids = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 4))]
            partial = Partial.of(output(ids, version, "stop"))
            session.record(prompt, partial)
            turns.append((prompt, Partial.of(output(ids, version, "stop"))))
            context = prompt + ids
        got, want = session_samples(session, 1.0), merged_as_lists(turns, 1.0)
        assert [pack_sample(s, "g") for s in got] == [pack_sample(s, "g") for s in want], case


def test_the_session_store_is_bounded_in_number_and_age():
    import time as _time

    from services.rollout_router.config import SessionConfig
    from services.rollout_router.gateway.session_store import SessionStore

    store = SessionStore(SessionConfig(max_sessions=2, session_ttl_s=60))
    for sid in ("a", "b", "c"):
        store.record(sid, [1], Partial.of(output([2], 0, "stop")))
    assert store.expire() == ["a"], "the oldest beyond max_sessions"
    store.sessions["b"].created = _time.monotonic() - 61
    assert store.expire() == ["b"], "past its time to live"
    assert list(store.sessions) == ["c"]
    assert store.add_to_group("g", [], size=2) is None
    assert store.add_to_group("g", [], size=2) == []
    assert "g" not in store.groups
    for sid in ("x", "y", "z"):  # the sessions a reward closed: the last max_sessions
        store.closed_by_reward(sid, "reward 1")
    assert list(store.rewarded) == ["y", "z"]
    store.record("z", [1], Partial.of(output([2], 0, "stop")))  # the id's new session
    assert list(store.rewarded) == ["y"]


def test_rollout_requests_carry_the_sampling_settings_and_stops():
    from proto.run_terms import RunTerms
    from services.rollout_router.config import RolloutConfig, SamplingConfig
    from services.rollout_router.rollout.loop import RolloutLoop

    sampling = SamplingConfig(
        rollout_max_response_len=9,
        rollout_temperature=0.7,
        rollout_top_p=0.9,
        rollout_top_k=20,
        rollout_stop=["</a>"],
    )
    loop = RolloutLoop(RunTerms(), RolloutConfig(), sampling, None, None, None, None, [2, 7])  # type: ignore[arg-type]
    body = loop.gen.payload([1, 5], n=8, max_new=9, greedy=False, seed=42)
    # n samples = a batch of n copies, each its own seed (SGLang's `n` shares one seed)
    assert body["input_ids"] == [[1, 5]] * 8 and body["return_logprob"] is True
    seeds = [p.pop("sampling_seed") for p in body["sampling_params"]]
    assert seeds == [sampling_seed(42, k) for k in range(8)] and len(set(seeds)) == 8
    assert (
        body["sampling_params"]
        == [
            {
                "max_new_tokens": 9,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 20,
                "n": 1,
                "stop_token_ids": [2, 7],
                "skip_special_tokens": True,
                "no_stop_trim": True,
                "stop": ["</a>"],
            }
        ]
        * 8
    )
    single = loop.gen.payload([1, 5], n=1, max_new=9, greedy=False, seed=42)
    assert single["input_ids"] == [1, 5] and single["sampling_params"]["sampling_seed"] == 42
    assert loop.gen.payload([1], 1, 9, True, 0)["sampling_params"]["temperature"] == 0.0


def test_the_session_memory_bench_runs_and_ends_with_its_ratio() -> None:
    import re

    from tests.helpers import run_bench

    small = ["--sessions", "2", "--turns", "3", "--prompt-len", "8", "--response-len", "4"]
    lines = run_bench("session_memory.py", *small, "--between-len", "2")
    # each session: 8 prompt tokens, then 3 responses of 4 with 2 tokens between them
    assert (
        lines[0]
        == "sessions: 2 x 3 turns, final context 24 tokens, 48 tokens in their samples (each once)"
    )
    assert re.fullmatch(r"session_memory_vs_stored: \d+\.\d\d", lines[-1]), lines[-1]


def test_a_run_without_progress_names_the_engine_that_answers_none_of_its_requests() -> None:
    """Engines paused through their own POST /pause_generation (not the router's) answer
    their health checks but no /generate: the old report said only `84 requests at the
    engines`. An engine answering, or holding nothing, is not named."""
    import time
    from types import SimpleNamespace

    from services.rollout_router.rollout.report import SILENT_ENGINE_S, busy

    now = time.monotonic()
    quiet = Worker("http://a:1", "a", outstanding=42, quiet_since=now - SILENT_ENGINE_S - 5)
    answering = Worker("http://b:1", "b", outstanding=42, quiet_since=now - 1)
    idle = Worker("http://c:1", "c", outstanding=0, quiet_since=now - 10 * SILENT_ENGINE_S)
    loop = SimpleNamespace(
        gen=SimpleNamespace(in_flight=84),
        pool=SimpleNamespace(workers={w.worker_id: w for w in (quiet, answering, idle)}),
        episodes=None,
        reward=SimpleNamespace(activity=lambda: ""),
        groups=[object()] * 64,
    )
    said = busy(loop)  # type: ignore[arg-type]
    assert said.startswith(
        "64 groups in flight: 84 requests at the engines; answered: http://a:1 none of its 42 "
        "for 65 s (long responses, or paused by POST /pause_generation there: POST"
    )
    assert "http://b:1" not in said and "http://c:1" not in said


def test_a_long_wait_is_said_once_a_minute_with_what_it_waits_for_now() -> None:
    """A router or broker run apart (as compose runs them) waited for the trainer without a
    word on its console: only its status in Redis said so. (The trainer's: its own test.)"""
    import time

    from services.common.long_wait import SAY_EVERY_S, LongWait

    said: list[str] = []
    wait = LongWait(said.append, quiet=("rollouts off",))
    long_ago = time.time() - SAY_EVERY_S - 5
    wait.check("waiting_for_buffer", "room: the trainer", time.time() - 5)  # not yet
    wait.check("waiting_for_buffer", "room: the trainer to consume", long_ago)
    wait.check("waiting_for_buffer", "room: the trainer to consume", long_ago)  # just said
    wait.check("rollouts off", "nothing: rollouts are off", long_ago - 600)  # no wait
    wait.check("generating", "", long_ago - 600)
    assert len(said) == 1, said
    assert re.fullmatch(
        r"waiting_for_buffer for 6\d s: waits for room: the trainer to consume", said[0]
    )
    wait.said_at -= SAY_EVERY_S  # a minute later, the same wait is said again
    wait.check("waiting_for_buffer", "room: the trainer to consume", long_ago - SAY_EVERY_S)
    assert len(said) == 2 and "for 12" in said[1], said


def test_a_refused_engine_whose_server_info_does_not_answer_stays_refused() -> None:
    """Each health round vets a refused engine again; under load its `/server_info` can time
    out. The context it said before holds (the old code took "not known" for "fits" and
    admitted an engine of context 4 under a response bound of 4: CI, 2026-12-08)."""
    answers: list[object] = [{"context_length": 4}, TimeoutError("slow"), {"context_length": 64}]

    class Pool:
        config = WorkerPoolConfig()

        async def get_json(self, url: str, path: str, timeout: float) -> object:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    gate = ContextGate(Pool(), lambda: 4)  # type: ignore[arg-type]
    assert "has a context length of 4 tokens" in asyncio.run(gate("http://e"))
    assert "has a context length of 4 tokens" in asyncio.run(gate("http://e"))
    assert asyncio.run(gate("http://e")) == "", "restarted with a larger context: admitted"
