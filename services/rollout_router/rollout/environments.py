"""Agent environments as HTTP servers: Tandem drives multi-turn episodes over a JSON protocol.

The protocol (`POST /reset`, `POST /step`), how a trajectory is built from exact token ids and
what a failing environment costs are in docs/protocols.md.
Evaluation (evaluation.py) plays one greedy episode per held-out task (docs/protocols.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from proto import DropReason, Sample
from services.common.chat_messages import MessageError, joined_text, template_messages
from services.rollout_router.config import EnvConfig
from services.rollout_router.gateway.chat_input import (
    as_sglang_tool,
    encode_prompt,
    prompt_char_limit,
)
from services.rollout_router.gateway.tool_calls import PARSERS
from services.rollout_router.rollout.calls import InFlight
from services.rollout_router.rollout.tasks import Item
from services.rollout_router.samples import Partial


class EnvError(RuntimeError):
    """An episode failed; `reason` is its drop counter (`env_error` or `env_timeout`)."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class ContextFullError(Exception):
    """The episode's context fills its bound (the model's positions, or what the trainer
    takes): no model turn fits after it."""

    def __init__(self, tokens: int, bound: int, what: str) -> None:
        super().__init__(f"{tokens} tokens fill {what}")
        self.tokens, self.bound = tokens, bound


class EnvClient:
    """The two protocol calls, each with its own timeout, over the router's shared session."""

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.calls = InFlight(f"calls to {self.url}", f"--env-call-timeout-s {timeout_s:g}")

    async def call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            with self.calls.one():
                async with self.session.post(
                    self.url + route, json=body, timeout=self.timeout
                ) as r:
                    if r.status != 200:  # (what it says, its first 300 bytes: it was left out)
                        said = (await r.content.read(300)).decode(errors="replace")
                        detail = f"{self.url}{route}: HTTP {r.status} {said}".strip()
                        raise EnvError(DropReason.ENV_ERROR, detail)
                    data = await r.json(content_type=None)
        except TimeoutError as exc:
            raise EnvError(DropReason.ENV_TIMEOUT, f"{self.url}{route}: no answer in time") from exc
        except (aiohttp.ClientError, ValueError) as exc:
            raise EnvError(
                DropReason.ENV_ERROR, f"{self.url}{route}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(data, dict):
            raise EnvError(DropReason.ENV_ERROR, f"{self.url}{route}: expected a JSON object")
        return data


Generate = Callable[[list[int], int], Awaitable[Partial]]
Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None

# The fixed history after which observation messages are rendered (docs/protocols.md).
HISTORY_USER, HISTORY_TURN = "Hello.", "TANDEM-ASSISTANT-TURN"


def as_messages(value: list[Any], what: str) -> Messages:
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        raise EnvError(
            DropReason.ENV_ERROR, f"{what}: chat messages must be objects with a role string"
        )
    return value


def as_tools(value: Any) -> Tools:
    """/reset's tools, OpenAI-style ones as SGLang lists them to the chat template."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise EnvError(DropReason.ENV_ERROR, "/reset tools: expected a list of function schemas")
    return [as_sglang_tool(t) if isinstance(t.get("function"), dict) else t for t in value]


class EpisodeRunner:
    """Runs one episode: reset, then model turn / environment step until done or max turns.

    An observation with more characters than the model's context (`context_len` positions,
    0: unknown) can hold fills it however it tokenizes, and is not tokenized: tokenizing
    megabytes held the router's event loop for seconds (health checks, every other episode's
    timeouts, agent sessions)."""

    def __init__(
        self, config: EnvConfig, client: EnvClient, tokenizer: Any, chat: bool, context_len: int = 0
    ) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.chat = chat
        self.parse_tool_calls = PARSERS[config.env_tool_call_parser]
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.char_limit = prompt_char_limit(tokenizer, context_len) if context_len else 0

    async def run(self, item: Item, episode_id: str, seed: int, generate: Generate) -> Sample:
        """`generate(context_ids, seed)` produces one finished model turn."""
        try:
            return await asyncio.wait_for(
                self._run(item, episode_id, seed, generate), self.config.env_episode_timeout_s
            )
        except TimeoutError as exc:
            raise EnvError(
                DropReason.ENV_TIMEOUT, f"episode {episode_id} passed its deadline"
            ) from exc

    async def run_all(
        self, item: Item, group_id: str, seed: int, n: int, turn_of: Callable[[str], Generate]
    ) -> tuple[list[Sample], list[tuple[str, EnvError]]]:
        """n episodes of one task at once, episode k with id `{group_id}-e{k}` and seed
        `seed + k` (`turn_of(episode_id)` makes its model turns): the finished samples, and
        the (episode id, error) of each that failed. Any other exception propagates."""
        ids = [f"{group_id}-e{k}" for k in range(n)]
        results = await asyncio.gather(
            *(self.run(item, eid, seed + k, turn_of(eid)) for k, eid in enumerate(ids)),
            return_exceptions=True,
        )
        samples, failed = [], []
        for episode_id, result in zip(ids, results, strict=True):
            if isinstance(result, EnvError):
                failed.append((episode_id, result))
            elif isinstance(result, BaseException):
                raise result
            else:
                samples.append(result)
        return samples, failed

    async def _run(self, item: Item, episode_id: str, seed: int, generate: Generate) -> Sample:
        task = {"prompt": item.prompt, "label": item.label}
        first = await self.client.call(
            "/reset", {"episode_id": episode_id, "seed": seed, "task": task}
        )
        tools = as_tools(first.get("tools"))
        prompt_ids = self.prompt_ids(first.get("observation"), item, tools)
        trajectory = Partial()
        mask: list[int] = []
        reward, done, kept = 0.0, False, (0, 0)
        for turn in range(self.config.env_max_turns):
            try:
                turn_out = await generate(prompt_ids + trajectory.ids, seed + turn)
            except ContextFullError as full:
                if turn == 0:
                    raise EnvError(
                        DropReason.PROMPT_TOO_LONG,
                        f"the first observation: {full}; shorten the environment's first "
                        "observation, or raise that bound",
                    ) from None
                _cut_to(trajectory, mask, kept)  # the last observation: no model turn follows
                break  # (the episode is cut short: finish "length")
            trajectory.extend_partial(turn_out)
            mask += [1] * len(turn_out.ids)
            step = await self.client.call("/step", self.step_body(episode_id, turn_out.text))
            reward += step_reward(step)
            done = step_done(step)
            if done or turn == self.config.env_max_turns - 1:
                break  # no model turn follows: a last observation would be dead weight
            obs = self.observation_text(step.get("observation"), turn_out, tools)
            if self.char_limit and len(obs) > self.char_limit:
                break  # it fills the context: the episode ends as a full one does (trained)
            obs_ids = self.tokenizer(obs, add_special_tokens=False)["input_ids"]
            kept = len(trajectory.ids), len(trajectory.text)
            trajectory.extend_unsampled(obs_ids, obs)
            mask += [0] * len(obs_ids)
        trajectory.finish = "stop" if done else "length"
        sample = trajectory.to_sample(prompt_ids, reward)
        sample.loss_mask = mask
        return sample

    def prompt_ids(self, observation: Any, item: Item, tools: Tools) -> list[int]:
        """The episode's prompt: the task's, or the first observation's."""
        if observation is None:
            return list(item.input_ids)
        if not isinstance(observation, str | list):  # (was 'chat template failed on /reset')
            raise EnvError(
                DropReason.ENV_ERROR,
                "/reset observation: expected a string, chat messages or null, got "
                f"{type(observation).__name__}",
            )
        if isinstance(observation, list):
            observation = as_messages(observation, "/reset observation")
        if self.char_limit and (chars := content_chars(observation)) > self.char_limit:
            raise EnvError(
                DropReason.PROMPT_TOO_LONG,
                f"the first observation: {chars} characters fill the model's context (more "
                "tokens than its positions); shorten the environment's first observation",
            )
        if isinstance(observation, list) and not self.templated:
            return list(self.tokenizer(joined(observation, "/reset observation"))["input_ids"])
        try:
            return list(encode_prompt(self.tokenizer, observation, self.chat, tools))
        # A chat template is code shipped with the model: whatever it raises on an
        # environment's messages fails that episode, not the rollout loop.
        except Exception as exc:
            raise EnvError(DropReason.ENV_ERROR, f"chat template failed on /reset: {exc}") from exc

    def step_body(self, episode_id: str, action: str) -> dict[str, Any]:
        body: dict[str, Any] = {"episode_id": episode_id, "action": action}
        if self.parse_tool_calls is not None:
            body["tool_calls"], body["tool_call_errors"] = self.parse_tool_calls(action)
        return body

    def observation_text(self, observation: Any, turn: Partial, tools: Tools) -> str:
        """The text appended after the model's turn (docs/protocols.md)."""
        if observation is None or isinstance(observation, str):
            return observation or ""
        if not isinstance(observation, list):
            raise EnvError(
                DropReason.ENV_ERROR,
                f"/step observation: expected a string or chat messages, got "
                f"{type(observation).__name__}",
            )
        messages = as_messages(observation, "/step observation")
        if not self.templated:
            return joined(messages, "/step observation")
        try:
            messages = template_messages(self.tokenizer, messages, tools)
        except MessageError as exc:
            raise EnvError(DropReason.ENV_ERROR, f"/step observation: {exc}") from exc
        history = [
            {"role": "user", "content": HISTORY_USER},
            {"role": "assistant", "content": HISTORY_TURN},
        ]
        try:
            base = self.tokenizer.apply_chat_template(history, tools=tools, tokenize=False)
            full = self.tokenizer.apply_chat_template(
                history + messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # as in prompt_ids
            raise EnvError(
                DropReason.ENV_ERROR, f"chat template failed on /step messages: {exc}"
            ) from exc
        end = base.rfind(HISTORY_TURN) + len(HISTORY_TURN)
        if end < len(HISTORY_TURN) or full[:end] != base[:end]:
            raise EnvError(
                DropReason.ENV_ERROR,
                "the chat template of --model renders the history differently "
                "when messages follow it: return the /step observation as a string",
            )
        text = full[end:]
        if turn.finish == "stop" and turn.ids:  # the model already wrote the end of its turn
            closing = self.tokenizer.decode(turn.ids[-1:], skip_special_tokens=False)
            if closing and text.startswith(closing):
                text = text[len(closing) :]
        return text


def step_reward(step: dict[str, Any]) -> float:
    """`/step`'s reward (absent: 0): a JSON number or boolean, never text (`"1"` would be
    read as 1 and `"0.5 (partial)"` fail later, far from the environment's fault)."""
    value = step.get("reward", 0.0)
    if not isinstance(value, (int, float)):
        raise EnvError(
            DropReason.ENV_ERROR, f"/step reward: expected a number, got {value!r} in {step!r}"
        )
    try:
        return float(value)
    except OverflowError:  # (an integer past a float's range: it raised out of the rollout loop)
        raise EnvError(
            DropReason.ENV_ERROR, f"/step reward: {str(value)[:20]}... is beyond a float's range"
        ) from None


def step_done(step: dict[str, Any]) -> bool:
    """`/step`'s done (absent or null: false): true or false (or 1, 0), never text (`"false"` is
    truthy and would end every episode after its first turn)."""
    value = step.get("done")
    if value is None or value in (True, False):  # (0 and 1 too)
        return bool(value)
    raise EnvError(
        DropReason.ENV_ERROR, f"/step done: expected true or false, got {value!r} in {step!r}"
    )


def content_chars(observation: Any) -> int:
    """The characters of an observation's text (a string's, or its messages' contents and text
    parts), which its rendering only adds to; 0 for anything else."""
    if isinstance(observation, str):
        return len(observation)
    if not isinstance(observation, list):
        return 0
    total = 0
    for message in observation:
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"text": content}]
        total += sum(
            len(p["text"]) for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return total


def joined(messages: Messages, where: str) -> str:
    """Messages without a chat template: their contents, one after the other, checked and made
    text as for a template that reads content as text (roles, text parts: EnvError naming one
    SGLang would refuse)."""
    try:
        return joined_text(messages)
    except MessageError as exc:
        raise EnvError(DropReason.ENV_ERROR, f"{where}: {exc}") from exc


def _cut_to(trajectory: Partial, mask: list[int], kept: tuple[int, int]) -> None:
    """Cut `trajectory` (and its loss `mask`) back to `kept` (tokens, text characters)."""
    tokens, chars = kept
    del trajectory.ids[tokens:], trajectory.logprobs[tokens:], trajectory.token_versions[tokens:]
    del mask[tokens:]
    trajectory.text = trajectory.text[:chars]
