"""From engine outputs to `Sample`s: exact tokens, log-probs, and per-token weight versions.

Knows: the SGLang `/generate` response shape and how an aborted output is continued.
Does not know: HTTP, Redis, rewards.

A response may arrive in segments: when an engine aborts generation for a weight update, the
output so far comes back with finish reason "abort"; partial rollout sends prompt + those tokens
again (on the new weights) and appends what follows. `Partial.token_versions` keeps the weight
version of every token, so the trainer can mask or correct the off-policy prefix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from proto import Sample
from proto.models import pack_routed_experts
from services.rollout_router.config import SamplingConfig


def parse_version(value: Any) -> int:
    """SGLang reports weight_version as a string ("3"); non-integers count as unknown (-1)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def sampling_seed(seed: int, *parts: int) -> int:
    """A stable 31-bit seed per (run seed, batch, prompt index, ...)."""
    key = "/".join(map(str, (seed, *parts))).encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def as_list(data: Any) -> list[dict[str, Any]]:
    """SGLang answers a single object for n=1 and a list for n>1."""
    return data if isinstance(data, list) else [data]


def drawn_at(temperature: float) -> float:
    """The temperature of the distribution an engine reports log-probs of for a request at
    `temperature` (`Sample.temperature`): itself, or 1 for greedy (below 1e-5, the reference
    engine's bound; SGLang's is 1e-6), whose log-probs SGLang reports unscaled."""
    return 1.0 if temperature < 1e-5 else temperature


def finish_type(out: dict[str, Any]) -> str:
    return (out.get("meta_info", {}).get("finish_reason") or {}).get("type", "length")


def stop_trimmed(out: dict[str, Any]) -> str:
    """The output's text, ending where a matched stop string ends: SGLang's rule under
    `no_stop_trim`, applied here too because an engine may return the whole decoded text when
    the last token reaches past the stop string."""
    text = out.get("text", "")
    matched = (out.get("meta_info", {}).get("finish_reason") or {}).get("matched")
    if isinstance(matched, str) and matched and (at := text.find(matched)) >= 0:
        return text[: at + len(matched)]
    return text


@dataclass
class Partial:
    """One response being assembled from one or more engine outputs."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = "length"
    continues: int = 0
    segment_versions: list[int] = field(default_factory=list)
    # base64 routing of the latest engine output: each request covers its whole input from
    # position 0, so the latest one covers every position of the sample
    routed_experts: str = ""
    # the request's sampling temperature (0 = greedy), the same for every segment and turn: a
    # continuation is asked at it, and the sample records the log-probs' (`drawn_at`)
    temperature: float = 1.0

    def extend(self, out: dict[str, Any]) -> None:
        """Append one engine output (the whole response, or the continuation of an abort)."""
        meta = out.get("meta_info", {})
        token_logprobs = meta.get("output_token_logprobs") or []
        version = parse_version(meta.get("weight_version"))
        self.ids += [int(t[1]) for t in token_logprobs]
        self.logprobs += [float(t[0]) for t in token_logprobs]
        self.token_versions += [version] * len(token_logprobs)
        self.segment_versions.append(version)
        self.text += stop_trimmed(out)
        self.finish = finish_type(out)
        self.routed_experts = meta.get("routed_experts") or ""

    def extend_partial(self, other: Partial) -> None:
        """Append another partial's tokens (the next turn of a conversation)."""
        self.ids += other.ids
        self.logprobs += other.logprobs
        self.token_versions += other.token_versions
        self.segment_versions += other.segment_versions
        self.text += other.text
        self.finish = other.finish
        self.routed_experts = other.routed_experts or self.routed_experts
        self.temperature = other.temperature

    def extend_unsampled(self, ids: list[int], text: str = "") -> None:
        """Append tokens the model did not sample (an observation, the messages between two
        turns): log-prob 0 and the last token's weight version; the loss mask leaves them out."""
        last = self.token_versions[-1] if self.token_versions else -1
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.token_versions += [last] * len(ids)
        self.text += text

    @classmethod
    def of(cls, out: dict[str, Any], temperature: float = 1.0) -> Partial:
        """The partial of one engine output of a request at `temperature`."""
        partial = cls(temperature=temperature)
        partial.extend(out)
        return partial

    def to_sample(self, prompt_ids: list[int], reward: float) -> Sample:
        # The sample's version is its oldest segment's: the staleness filter must see the prefix.
        version = min(self.segment_versions, default=-1)
        return Sample(
            prompt_ids=prompt_ids,
            response_ids=self.ids,
            response_logprobs=self.logprobs,
            loss_mask=[1] * len(self.ids),
            reward=reward,
            weight_version=version,
            token_versions=self.token_versions,
            finish_reason=self.finish,
            response_text=self.text,
            routed_experts=pack_routed_experts(self.routed_experts) if self.routed_experts else b"",
            temperature=drawn_at(self.temperature),
        )


def generate_body(
    s: SamplingConfig,
    stop_token_ids: list[int],
    input_ids: list[int],
    n: int,
    max_new: int,
    greedy: bool,
    seed: int,
) -> dict[str, Any]:
    """One /generate body. n > 1 is a batch of n copies of the prompt, copy k seeded with
    `sampling_seed(seed, k)`: n distinct samples, reproducible where the engine honours seeds
    (not SGLang's `n`, whose samples share one seed; see the README)."""

    def params(copy_seed: int) -> dict[str, Any]:
        return {
            "max_new_tokens": max_new,
            "temperature": 0.0 if greedy else s.rollout_temperature,
            "top_p": s.rollout_top_p,
            "top_k": s.rollout_top_k,
            "n": 1,
            "stop_token_ids": stop_token_ids,
            "sampling_seed": copy_seed,
            "skip_special_tokens": True,
            # keep a matched stop string or stop token in the text (SGLang trims it by
            # default): the text the reward reads then matches the tokens trained on
            "no_stop_trim": True,
            **({"stop": s.rollout_stop} if s.rollout_stop else {}),
        }

    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params(seed)}
    if n > 1:
        body["input_ids"] = [list(input_ids) for _ in range(n)]
        body["sampling_params"] = [params(sampling_seed(seed, k)) for k in range(n)]
    replay = {"return_routed_experts": True} if s.return_routed_experts else {}
    return {**body, "return_logprob": True, **replay}
