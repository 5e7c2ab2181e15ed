"""Agent environments as HTTP servers: Tandem drives multi-turn episodes over a JSON protocol.

Protocol (the environment implements two routes; `examples/guess_env.py` is one):
- `POST {env}/reset {"episode_id": str, "seed": int, "task": {"prompt": ..., "label": ...}}`
  -> `{"observation": str | [chat messages] | null}`. A null observation means "use the task's
  prompt". The first observation is the episode's prompt (chat messages go through the model's
  chat template).
- `POST {env}/step {"episode_id": str, "action": str}` -> `{"observation": str, "reward": float,
  "done": bool}`. `action` is the model's whole turn as text (tool calls are text the
  environment parses, e.g. `CALL calc(2+3)`); `observation` is the environment's reply, which
  becomes the start of the next model turn.

Token accounting: the trajectory is built from exact token ids, never by re-tokenizing old text.
The context of turn t+1 is the context of turn t + the model's tokens + the observation's tokens
(`tokenizer(observation, add_special_tokens=False)`). In the resulting `Sample`, the response is
every token after the prompt; `loss_mask` is 1 on model tokens and 0 on environment tokens
(whose log-probs are 0 and whose version is the preceding turn's). The reward is the sum of the
step rewards.

Failure: every call has `env_call_timeout_s` and the whole episode `env_episode_timeout_s`. A
failing or hung environment fails only its episode (`EnvError`, reason `env_error` or
`env_timeout`); the rest of the batch goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from proto import Sample
from services.rollout_router.config import EnvConfig
from services.rollout_router.samples import Partial
from services.rollout_router.tasks import Item, encode_prompt


class EnvError(RuntimeError):
    """An episode failed; `reason` is its drop counter (`env_error` or `env_timeout`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class EnvClient:
    """The two protocol calls, each with its own timeout, over the router's shared session."""

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self.session.post(self.url + route, json=body, timeout=self.timeout) as r:
                if r.status != 200:
                    raise EnvError("env_error", f"{self.url}{route}: HTTP {r.status}")
                data = await r.json(content_type=None)
        except TimeoutError as exc:
            raise EnvError("env_timeout", f"{self.url}{route}: no answer in time") from exc
        except (aiohttp.ClientError, ValueError) as exc:
            raise EnvError("env_error", f"{self.url}{route}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(data, dict):
            raise EnvError("env_error", f"{self.url}{route}: expected a JSON object")
        return data


Generate = Callable[[list[int], int], Awaitable[Partial]]


class EpisodeRunner:
    """Runs one episode: reset, then model turn / environment step until done or max turns."""

    def __init__(self, config: EnvConfig, client: EnvClient, tokenizer: Any, chat: bool) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.chat = chat

    async def run(self, item: Item, episode_id: str, seed: int, generate: Generate) -> Sample:
        """`generate(context_ids, seed)` produces one finished model turn."""
        try:
            return await asyncio.wait_for(
                self._run(item, episode_id, seed, generate), self.config.env_episode_timeout_s
            )
        except TimeoutError as exc:
            raise EnvError("env_timeout", f"episode {episode_id} passed its deadline") from exc

    async def _run(self, item: Item, episode_id: str, seed: int, generate: Generate) -> Sample:
        task = {"prompt": item.prompt, "label": item.label}
        first = await self.client.call(
            "/reset", {"episode_id": episode_id, "seed": seed, "task": task}
        )
        observation = first.get("observation")
        prompt_ids = (
            list(item.input_ids)
            if observation is None
            else list(encode_prompt(self.tokenizer, observation, self.chat))
        )
        trajectory = Partial()
        mask: list[int] = []
        reward, done = 0.0, False
        for turn in range(self.config.env_max_turns):
            turn_out = await generate(prompt_ids + trajectory.ids, seed + turn)
            trajectory.extend_partial(turn_out)
            mask += [1] * len(turn_out.ids)
            step = await self.client.call(
                "/step", {"episode_id": episode_id, "action": turn_out.text}
            )
            try:
                reward += float(step.get("reward", 0.0))
            except (TypeError, ValueError) as exc:
                raise EnvError("env_error", f"step reward is not a number: {step!r}") from exc
            done = bool(step.get("done", False))
            if done:
                break
            obs = str(step.get("observation", ""))
            obs_ids = self.tokenizer(obs, add_special_tokens=False)["input_ids"]
            last_version = trajectory.token_versions[-1] if trajectory.token_versions else -1
            trajectory.ids += obs_ids
            trajectory.logprobs += [0.0] * len(obs_ids)
            trajectory.token_versions += [last_version] * len(obs_ids)
            trajectory.text += obs
            mask += [0] * len(obs_ids)
        trajectory.finish = "stop" if done else "length"
        sample = trajectory.to_sample(prompt_ids, reward)
        sample.loss_mask = mask
        return sample
