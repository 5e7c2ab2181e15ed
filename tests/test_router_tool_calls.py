"""Tool calls in agent episodes: parsed (Hermes/Qwen style) or left as text, malformed ones
explained, exact tokens kept; the example calculator environment under the router."""

from __future__ import annotations

import itertools
import json
import operator
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from tests.helpers import read_all, serving, wait_until
from tests.test_router_agents import ROOT, ScriptedEnv, router_args

# A Hermes/Qwen-style template over a character-level vocabulary: tool results become
# `<tool_response>` blocks in a user turn, the tools are listed in a system turn.
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}"
    "{{ ' ' + t['function']['name'] }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>' + m['content'] + '</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
CALL = '{"name": "calculator", "arguments": {"expression": "2+3"}}'
BAD_CALL = '{"name": "calculator", "arguments": {"expression": '
# The model's every turn, token by token: one well-formed call, one malformed, end of turn.
TURN = [
    "<tool_call>",
    CALL,
    "</tool_call>",
    " <tool_call>",
    BAD_CALL,
    " </tool_call>",
    "<|im_end|>",
]
TURN_TEXT = "".join(TURN[:-1])
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


def write_tool_model(out: Path) -> Path:
    """A Llama checkpoint the reference engine serves, built so that its greedy output is
    `TURN` after every assistant header: a character vocabulary plus one token per piece of
    `TURN`, one-hot embeddings, attention and MLP outputs zeroed (the residual stream stays the
    current token's embedding), and an LM head mapping each token to its successor (`\\n` ->
    `<tool_call>` -> ... -> `<|im_end|>`, anything else -> `<|im_end|>`). A bigram machine,
    run by the real forward pass and sampler."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_tokens(TURN[:-1])
    tokenizer.chat_template = TOOL_TEMPLATE
    size, hidden = len(tokenizer), 128
    turn = tokenizer.convert_tokens_to_ids(TURN)
    successor = {tokenizer.convert_tokens_to_ids("\n"): turn[0], **dict(itertools.pairwise(turn))}
    config = LlamaConfig(
        vocab_size=size,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=turn[-1],
        pad_token_id=0,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :size] = torch.eye(size)
        model.lm_head.weight.zero_()
        for token in range(size):
            model.lm_head.weight[successor.get(token, turn[-1]), token] = 1.0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_model(tmp_path_factory.mktemp("toolmodel") / "model")


@pytest.fixture
def tool_engine(start_service, tool_model_dir):
    return start_service("engine", ["engine", "--model", str(tool_model_dir), "--port", "0"])


class ToolEnv(ScriptedEnv):
    """Resets with the question and the calculator tool; answers the first step with a tool
    message and ends at the second. Every /step body is kept in `steps`."""

    steps: ClassVar[list[dict]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server names it
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/reset":
            return self.send_json(200, {"observation": QUESTION, "tools": TOOLS})
        self.steps.append(body)
        if sum(s["episode_id"] == body["episode_id"] for s in self.steps) == 1:
            reply = {"observation": [{"role": "tool", "content": "5"}], "reward": 0.25}
            return self.send_json(200, {**reply, "done": False})
        self.send_json(200, {"observation": "", "reward": 0.5, "done": True})


@pytest.fixture
def tool_env() -> Iterator[tuple[str, list[dict]]]:
    steps: list[dict] = []
    with serving(type("Env", (ToolEnv,), {"steps": steps})) as url:
        yield url, steps


def tool_router_args(buffer, model: Path, engine_url: str, env_url: str, *extra: str) -> list[str]:
    return router_args(
        buffer,
        model,
        [engine_url],
        "--env-url",
        env_url,
        "--rollout-temperature",
        "0",
        "--rollout-max-response-len",
        "16",
        *extra,
    )


def test_parsed_tool_calls_and_malformed_ones_reach_the_environment_with_exact_tokens(
    buffer, tool_model_dir, start_service, tool_engine, tool_env
):
    from transformers import AutoTokenizer

    env_url, steps = tool_env
    start_service("router", tool_router_args(buffer, tool_model_dir, tool_engine.url, env_url))
    wait_until(lambda: buffer.depth() >= 2, "a batch of tool-calling episodes")
    groups = read_all(buffer)
    done = {g.group_id for g in groups}  # later batches may still be running
    steps = [s for s in list(steps) if s["episode_id"].rsplit("-e", 1)[0] in done]
    episodes = {s["episode_id"] for s in steps}
    assert len(episodes) >= 6 and len(steps) == 2 * len(episodes), "each went on after turn 1"
    for step in steps:
        assert step["action"] == TURN_TEXT
        assert step["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "2+3"}}]
        (error,) = step["tool_call_errors"]
        assert error.startswith("tool call 2: not JSON") and "expression" in error
    tokenizer = AutoTokenizer.from_pretrained(str(tool_model_dir))
    prompt = tokenizer.apply_chat_template(
        QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    # After the model's `<|im_end|>` the template writes `\n`, the tool turn, the next header.
    observation = (
        "\n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    turn = tokenizer.convert_tokens_to_ids(TURN)
    env_ids = tokenizer(observation, add_special_tokens=False)["input_ids"]
    for s in (s for g in groups for s in g.samples):
        assert s.prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert s.response_ids == turn + env_ids + turn
        assert s.loss_mask == [1] * len(turn) + [0] * len(env_ids) + [1] * len(turn)
        model_lps = [lp for lp, m in zip(s.response_logprobs, s.loss_mask, strict=True) if m]
        assert all(-0.01 < lp < 0 for lp in model_lps), "the engine's log-probs of its tokens"
        assert s.response_logprobs[len(turn) : -len(turn)] == [0.0] * len(env_ids)
        assert s.response_text == TURN_TEXT + observation + TURN_TEXT
        assert s.reward == pytest.approx(0.75) and s.finish_reason == "stop"


def test_with_the_none_parser_the_environment_gets_the_text_only(
    buffer, tool_model_dir, start_service, tool_engine, tool_env
):
    env_url, steps = tool_env
    start_service(
        "router",
        tool_router_args(
            buffer, tool_model_dir, tool_engine.url, env_url, "--env-tool-call-parser", "none"
        ),
    )
    wait_until(lambda: buffer.depth() >= 2, "a batch of episodes")
    assert steps and all(set(s) == {"episode_id", "action"} for s in steps)


def test_the_example_calculator_environment_answers_tool_calls_under_the_router(
    buffer, tool_model_dir, start_service, tool_engine
):
    from transformers import AutoTokenizer

    from services.sample_buffer.server import _free_port

    port = _free_port("127.0.0.1")
    env = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples/calc_env.py"),
            "--port",
            str(port),
            "--max-turns",
            "2",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert env.stdout is not None and "calc env on" in env.stdout.readline().decode()
        start_service(
            "router",
            tool_router_args(buffer, tool_model_dir, tool_engine.url, f"http://127.0.0.1:{port}"),
        )
        wait_until(lambda: buffer.depth() >= 2, "episodes of the calculator environment")
        drops = buffer.drop_counts("samples")  # before the environment stops under the router
    finally:
        env.terminate()
        env.wait()
    tokenizer = AutoTokenizer.from_pretrained(str(tool_model_dir))
    for s in (s for g in read_all(buffer) for s in g.samples):
        env_ids = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if not m]
        replies = tokenizer.decode(env_ids)
        assert "<tool_response>5</tool_response>" in replies, "calculator(2+3) was run"
        assert "<tool_response>error: tool call 2: not JSON" in replies
        assert s.reward == 0.0 and s.finish_reason == "stop", "no answer in two turns"
        assert tokenizer.decode(s.prompt_ids).startswith("<|im_start|>system\nTools: calculator")
    assert drops == {}


def test_the_example_calculator_scores_answers_and_explains_bad_calls():
    from services.sample_buffer.server import _free_port

    port = _free_port("127.0.0.1")
    env = subprocess.Popen(
        [sys.executable, str(ROOT / "examples/calc_env.py"), "--port", str(port)],
        stdout=subprocess.PIPE,
    )
    try:
        assert env.stdout is not None and "calc env on" in env.stdout.readline().decode()
        url = f"http://127.0.0.1:{port}"
        question = httpx.post(url + "/reset", json={"episode_id": "e", "seed": 7}).json()
        assert question["tools"][0]["function"]["name"] == "calculator"
        a, op, b = re.fullmatch(
            r"What is (\d+)([-+*])(\d+)\? Use the calculator\.",
            question["observation"][0]["content"],
        ).groups()
        calls = [
            {"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}},
            {"name": "calculator", "arguments": {"expression": "1/0"}},
            {"name": "search", "arguments": {}},
        ]
        reply = httpx.post(
            url + "/step",
            json={
                "episode_id": "e",
                "action": "...",
                "tool_calls": calls,
                "tool_call_errors": ["tool call 4: bad"],
            },
        ).json()
        ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
        value = str(ops[op](int(a), int(b)))
        assert [m["content"] for m in reply["observation"]] == [
            value,
            "error: division by zero",
            "error: unknown tool 'search' (the tool is calculator)",
            "error: tool call 4: bad",
        ]
        assert reply["done"] is False and all(m["role"] == "tool" for m in reply["observation"])
        answer = httpx.post(
            url + "/step",
            json={
                "episode_id": "e",
                "action": f"It is {value}.",
                "tool_calls": [],
                "tool_call_errors": [],
            },
        ).json()
        assert answer == {"observation": "", "reward": 1.0, "done": True}
        httpx.post(url + "/reset", json={"episode_id": "f", "seed": 7})
        wrong = httpx.post(url + "/step", json={"episode_id": "f", "action": "0"}).json()
        assert wrong["reward"] == 0.0 and wrong["done"] is True
    finally:
        env.terminate()
        env.wait()


def test_the_example_calculator_runs_on_the_toy_model_without_a_chat_template(
    buffer, toy_model_dir, start_service, engines
):
    """`tandem up`'s default model has no chat template: message observations are joined."""
    from transformers import AutoTokenizer

    from services.sample_buffer.server import _free_port

    port = _free_port("127.0.0.1")
    env = subprocess.Popen(
        [sys.executable, str(ROOT / "examples/calc_env.py"), "--port", str(port)],
        stdout=subprocess.PIPE,
    )
    try:
        assert env.stdout is not None and "calc env on" in env.stdout.readline().decode()
        start_service(
            "router",
            router_args(
                buffer, toy_model_dir, [engines().url], "--env-url", f"http://127.0.0.1:{port}"
            ),
        )
        wait_until(lambda: buffer.depth() >= 2, "episodes on the toy model")
        drops = buffer.drop_counts("samples")  # before the environment stops under the router
    finally:
        env.terminate()
        env.wait()
    tokenizer = AutoTokenizer.from_pretrained(str(toy_model_dir))
    for s in (s for g in read_all(buffer) for s in g.samples):
        # BOS, then one token per character of `What is AB?CD? Use the calculator.` (the
        # toy vocabulary knows only the digits of it)
        assert s.prompt_ids[0] == 1 and len(s.prompt_ids) == 1 + 34
        assert re.fullmatch(r"\d{4}", tokenizer.decode(s.prompt_ids, skip_special_tokens=True))
        assert s.loss_mask == [1] * len(s.response_ids), "no tool call: the first turn answers"
    assert drops == {}


def test_hermes_tool_calls_are_read_with_their_arguments_and_bad_ones_explained():
    from services.rollout_router.gateway.tool_calls import parse_hermes

    text = (
        'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}'
        '\n</tool_call> and <tool_call>{"name": "lookup", "arguments": "{\\"q\\": \\"x\\"}"}'
        '</tool_call><tool_call>{"name": "now"}</tool_call>'
    )
    assert parse_hermes(text) == (
        [
            {"name": "calculator", "arguments": {"expression": "2+3"}},
            {"name": "lookup", "arguments": {"q": "x"}},
            {"name": "now", "arguments": {}},
        ],
        [],
    )
    assert parse_hermes("no calls here") == ([], [])
    calls, errors = parse_hermes(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": </tool_call>'
        '<tool_call>["a"]</tool_call><tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": [1]}</tool_call><tool_call>{"name": "c"'
    )
    assert calls == [{"name": "a", "arguments": {}}]
    assert [e.split(":")[0] for e in errors] == [f"tool call {n}" for n in (2, 3, 4, 5, 6)]
    assert "not JSON (Expecting value" in errors[0] and "not a JSON object" in errors[1]
    assert 'no "name" string' in errors[2] and '"arguments" is not a JSON object' in errors[3]
    assert "<tool_call> without </tool_call>" in errors[4]


def test_observation_messages_close_the_turn_and_a_history_changing_template_is_refused(
    tool_model_dir,
):
    from transformers import AutoTokenizer

    from services.rollout_router.config import EnvConfig
    from services.rollout_router.rollout.environments import EnvError, EpisodeRunner
    from services.rollout_router.samples import Partial

    tokenizer = AutoTokenizer.from_pretrained(str(tool_model_dir))
    runner = EpisodeRunner(EnvConfig(), None, tokenizer, chat=False)
    tool = [{"role": "tool", "content": "5"}]
    rest = "<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ended = Partial(ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")], finish="stop")
    assert runner.observation_text(tool, ended, None) == "\n" + rest, "the model wrote <|im_end|>"
    cut = Partial(ids=[tokenizer.convert_tokens_to_ids("x")], finish="length")
    assert runner.observation_text(tool, cut, None) == "<|im_end|>\n" + rest, "closed for it"
    assert runner.observation_text("raw text", ended, None) == "raw text"
    with pytest.raises(EnvError, match="expected a string or chat messages"):
        runner.observation_text({"role": "tool"}, ended, None)
    tokenizer.chat_template = "{% for m in messages %}{{ raise_exception('no tools') }}{% endfor %}"
    with pytest.raises(EnvError, match="chat template failed on /step messages: no tools"):
        runner.observation_text(tool, ended, None)
    tokenizer.chat_template = (  # marks the last message: the history changes when one follows
        "{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(EnvError, match="renders the history differently"):
        runner.observation_text(tool, ended, None)
