"""`tandem engine` as a real process: /generate shapes, determinism, batching, logprob parity.

The engine runs through the real CLI on the toy model; the reference for logprobs is a
teacher-forced `transformers` forward of the same checkpoint in this process.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import pytest
import torch

PROMPT = [1, 4, 5, 14]  # "<bos>01>"


@pytest.fixture(scope="module")
def engine(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One engine process shared by this module's tests (start-up costs a few seconds)."""
    from conftest import ServiceProcess

    service = ServiceProcess(
        ["engine", "--model", str(toy_model_dir), "--port", "0"],
        tmp_path_factory.mktemp("engine"),
        "engine",
    )
    yield service
    service.stop()


def generate(url: str, body: dict, status: int = 200) -> dict | list:
    resp = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    return resp.json()


def teacher_forced_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[t] | prompt + output[:t]) from one full-sequence transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(output)[:, None])[:, 0]


def test_generate_answers_every_sglang_field(engine) -> None:  # type: ignore[no-untyped-def]
    out = generate(
        engine.url,
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "rid": "req-1",
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True},
        },
    )
    assert isinstance(out, dict)
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert isinstance(out["text"], str)
    assert len(out["output_ids"]) == 6 and all(isinstance(t, int) for t in out["output_ids"])
    meta = out["meta_info"]
    assert meta["id"] == "req-1"
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == 6
    assert meta["cached_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["weight_version"] == "0"
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"]
    assert all(e[0] <= 0.0 and e[2] is None for e in entries)


def test_generation_stops_on_eos_and_reports_the_matched_id(engine) -> None:  # type: ignore[no-untyped-def]
    # token 2 is <eos>; with stop_token_ids naming every token the first one must stop
    out = generate(
        engine.url,
        {
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 0,
                "stop_token_ids": list(range(16)),
            },
        },
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][0]}
    assert len(out["output_ids"]) == 1


def test_text_input_and_a_batch_answer_a_list_in_prompt_order(engine) -> None:  # type: ignore[no-untyped-def]
    single = generate(
        engine.url, {"text": "01>", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    )
    batch = generate(
        engine.url,
        {
            "text": ["01>", "987>"],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        },
    )
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"]
    assert single["meta_info"]["prompt_tokens"] == 4  # <bos> is prepended by the tokenizer
    assert batch[1]["meta_info"]["prompt_tokens"] == 5


def test_greedy_generation_is_deterministic(engine) -> None:  # type: ignore[no-untyped-def]
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    outputs = [generate(engine.url, body)["output_ids"] for _ in range(3)]
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == 12


def test_seeded_sample_is_the_same_alone_and_inside_a_concurrent_batch(engine) -> None:  # type: ignore[no-untyped-def]
    seeded = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": 10,
            "temperature": 1.0,
            "sampling_seed": 1234,
            "ignore_eos": True,
        },
    }
    alone = generate(engine.url, seeded)
    others = [
        {
            "input_ids": [1, *[4 + i % 10] * (1 + i % 5)],
            "sampling_params": {
                "max_new_tokens": 3 + i % 9,
                "temperature": 0.7,
                "top_p": 0.9,
                "n": 1 + i % 3,
            },
        }
        for i in range(24)
    ]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(generate, engine.url, b) for b in others[:12]]
        mine = pool.submit(generate, engine.url, seeded)
        futures += [pool.submit(generate, engine.url, b) for b in others[12:]]
        batched = mine.result()
        for f in futures:
            f.result()
    assert batched["output_ids"] == alone["output_ids"]
    lp_alone = [e[0] for e in alone["meta_info"]["output_token_logprobs"]]
    lp_batched = [e[0] for e in batched["meta_info"]["output_token_logprobs"]]
    assert lp_batched == pytest.approx(lp_alone, abs=1e-5)


def test_n_samples_answer_a_list_of_n_seeded_from_sampling_seed_and_index(engine) -> None:  # type: ignore[no-untyped-def]
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 8,
            "temperature": 1.0,
            "n": 4,
            "sampling_seed": 7,
            "ignore_eos": True,
        },
    }
    first, second = generate(engine.url, body), generate(engine.url, body)
    assert isinstance(first, list) and len(first) == 4
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in second]
    assert len({tuple(r["output_ids"]) for r in first}) > 1  # samples differ from each other
    assert len({r["meta_info"]["id"] for r in first}) == 4


def test_output_logprobs_match_a_teacher_forced_transformers_forward(engine, toy_model_dir) -> None:  # type: ignore[no-untyped-def]
    results = generate(
        engine.url,
        {
            "input_ids": [PROMPT, [1, 9, 9, 8, 7, 14]],
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 20,
                "temperature": 1.0,
                "n": 3,
                "ignore_eos": True,
            },
        },
    )
    prompts = [PROMPT] * 3 + [[1, 9, 9, 8, 7, 14]] * 3
    worst = 0.0
    for prompt, result in zip(prompts, results, strict=True):
        engine_lp = torch.tensor([e[0] for e in result["meta_info"]["output_token_logprobs"]])
        reference = teacher_forced_logprobs(toy_model_dir, prompt, result["output_ids"])
        worst = max(worst, float((engine_lp - reference).abs().max()))
    print(f"logprob max abs diff vs teacher-forced transformers: {worst:.3e}")
    assert worst < 1e-4


def test_temperature_scales_the_reported_logprobs(engine, toy_model_dir) -> None:  # type: ignore[no-untyped-def]
    out = generate(
        engine.url,
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0.5, "ignore_eos": True},
        },
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32)
    ids = PROMPT + out["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(logits / 0.5, -1).gather(
        1, torch.tensor(out["output_ids"])[:, None]
    )[:, 0]
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert (got - expected).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"sampling_params": {"max_new_tokens": 2}}, "input_ids"),
        ({"input_ids": [1, 99]}, "input_ids"),
        ({"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 500}}, "max_new_tokens"),
        ({"input_ids": PROMPT, "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": PROMPT, "return_logprob": "yes"}, "return_logprob"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(engine, body: dict, field: str) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(f"{engine.url}/generate", json=body, timeout=30)
    assert resp.status_code == 400
    assert field in resp.json()["error"]["message"]


def test_info_routes_report_model_and_weight_version(engine, toy_model_dir) -> None:  # type: ignore[no-untyped-def]
    assert httpx.get(f"{engine.url}/health").status_code == 200
    assert httpx.get(f"{engine.url}/health_generate", timeout=30).status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(f"{engine.url}{path}").json()
        assert info["model_path"] == str(toy_model_dir)
        assert info["tokenizer_path"] == str(toy_model_dir)
        assert info["is_generation"] is True
        assert "preferred_sampling_params" in info
        assert info["weight_version"] == "0"
    assert httpx.get(f"{engine.url}/get_weight_version").json() == {"weight_version": "0"}
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{engine.url}/flush_cache").status_code == 200


def test_stop_string_is_reported_and_trimmed_unless_no_stop_trim(engine) -> None:  # type: ignore[no-untyped-def]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = generate(engine.url, {"input_ids": PROMPT, "sampling_params": params})["text"]
    stop = full[3]
    cut = generate(engine.url, {"input_ids": PROMPT, "sampling_params": {**params, "stop": stop}})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == full[: full.find(stop)]
    kept = generate(
        engine.url,
        {"input_ids": PROMPT, "sampling_params": {**params, "stop": [stop], "no_stop_trim": True}},
    )
    assert kept["text"] == full[: full.find(stop) + 1]
    assert kept["output_ids"] == cut["output_ids"]


def test_min_new_tokens_holds_back_eos(engine) -> None:  # type: ignore[no-untyped-def]
    stops = list(range(4, 16))  # every token but <pad>, <bos>, <eos>, <unk>
    for seed in range(5):
        out = generate(
            engine.url,
            {
                "input_ids": PROMPT,
                "sampling_params": {
                    "max_new_tokens": 8,
                    "min_new_tokens": 3,
                    "stop_token_ids": stops,
                    "sampling_seed": seed,
                },
            },
        )
        assert len(out["output_ids"]) >= 4
        assert all(t in (0, 1, 3) for t in out["output_ids"][:3])


def test_no_post_route_answers_garbage_with_a_server_error(engine) -> None:  # type: ignore[no-untyped-def]
    stateful = {
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
    paths = [
        path
        for path, ops in httpx.get(f"{engine.url}/openapi.json").json()["paths"].items()
        if "post" in ops and path not in stateful
    ]
    assert "/update_weights_from_distributed" in paths and "/v1/completions" in paths
    bodies = [
        b"not json",
        b"[1, 2]",
        b"{}",
        b'{"names": 5, "input_ids": {"a": 1}, "prompt": 3}',
        b'{"master_address": 1, "master_port": "x", "world_size": 2, "messages": [1]}',
    ]
    for path in paths:
        for body in bodies:
            resp = httpx.post(
                f"{engine.url}{path}",
                content=body,
                timeout=30,
                headers={"content-type": "application/json"},
            )
            assert 400 <= resp.status_code < 500, (path, body, resp.status_code, resp.text)


def test_prompt_logprobs_from_logprob_start_len_match_teacher_forcing(
    engine, toy_model_dir
) -> None:  # type: ignore[no-untyped-def]
    prompt = [1, 9, 9, 8, 7, 14]
    scored = generate(
        engine.url,
        {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        },
    )
    meta = scored["meta_info"]
    assert scored["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    reference = teacher_forced_logprobs(toy_model_dir, prompt[:1], prompt[1:])
    assert torch.tensor([e[0] for e in entries[1:]]) == pytest.approx(reference, abs=1e-4)
    tail = generate(
        engine.url,
        {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 3,
            "sampling_params": {"max_new_tokens": 2, "n": 2},
        },
    )
    for result in tail:
        assert [e[1] for e in result["meta_info"]["input_token_logprobs"]] == prompt[3:]
        assert [e[0] for e in result["meta_info"]["input_token_logprobs"]] == pytest.approx(
            [e[0] for e in entries[3:]], abs=1e-5
        )
    default = generate(
        engine.url,
        {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 1}},
    )
    assert default["meta_info"]["input_token_logprobs"] == []


def test_a_repeated_prompt_is_served_from_the_prompt_cache_until_flushed(engine) -> None:  # type: ignore[no-untyped-def]
    prompt = [1, 13, 12, 11, 14]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "sampling_seed": 5, "ignore_eos": True},
    }
    assert httpx.post(f"{engine.url}/flush_cache").status_code == 200
    first, second = generate(engine.url, body), generate(engine.url, body)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == len(prompt)
    assert second["output_ids"] == first["output_ids"]
    lps = [[e[0] for e in r["meta_info"]["output_token_logprobs"]] for r in (first, second)]
    assert lps[1] == pytest.approx(lps[0], abs=1e-6)
    assert httpx.post(f"{engine.url}/flush_cache").status_code == 200
    assert generate(engine.url, body)["meta_info"]["cached_tokens"] == 0


def test_a_stop_string_ending_inside_a_token_cuts_the_text_where_sglang_does() -> None:
    """With multi-character tokens the last token can decode past the stop string: SGLang cuts
    the text before the string, or (no_stop_trim) right after it, never at a token boundary."""
    from types import SimpleNamespace

    from services.engine.api import output_text

    pieces = {5: "ab", 6: "cd", 7: "ef"}
    tokenizer = SimpleNamespace(
        decode=lambda ids, skip_special_tokens=True: "".join(pieces[i] for i in ids)
    )
    reason = {"type": "stop", "matched": "bc"}
    for no_stop_trim, expected in ((False, "a"), (True, "abc")):
        seq = SimpleNamespace(
            params=SimpleNamespace(no_stop_trim=no_stop_trim, skip_special_tokens=True)
        )
        assert output_text(seq, [5, 6], tokenizer, reason) == expected  # type: ignore[arg-type]
    # A stop token is dropped from the text unless no_stop_trim.
    token_reason = {"type": "stop", "matched": 7}
    trimmed = SimpleNamespace(params=SimpleNamespace(no_stop_trim=False, skip_special_tokens=True))
    kept = SimpleNamespace(params=SimpleNamespace(no_stop_trim=True, skip_special_tokens=True))
    assert output_text(trimmed, [5, 7], tokenizer, token_reason) == "ab"  # type: ignore[arg-type]
    assert output_text(kept, [5, 7], tokenizer, token_reason) == "abef"  # type: ignore[arg-type]
