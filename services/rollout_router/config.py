"""The router's configuration: one dataclass with a sub-config per component.

`WorkerPoolConfig` goes to the worker pool (balancing, health, retries), `RolloutConfig` to the
rollout loop (task, batch shape, sampling, staleness), `BufferConfig` to the Redis sample buffer.
Flag names follow slime where the concept is the same (`--rollout-batch-size`,
`--n-samples-per-prompt`, `--rollout-max-response-len`, `--rollout-temperature`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proto.contract import RunContract, model_identity
from proto.models import check_model_config, read_config
from services.rollout_router.config_checks import (
    DEFAULT_DEPTH_BATCHES,
    check_buffer_depth,
    check_response_len,
)
from services.rollout_router.gateway.tool_calls import PARSERS as TOOL_CALL_PARSERS
from services.sample_buffer import BufferConfig

POLICIES = ("least_outstanding", "round_robin", "session_affinity")


@dataclass
class WorkerPoolConfig:
    """Which engines to use and how to balance, health-check and retry across them."""

    engine_urls: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Base URLs of SGLang-compatible engines (more can be added at run time)."
        },
    )
    engine_wait_timeout_s: float = field(
        default=300.0,
        metadata={"help": "How long start-up waits for every engine's /model_info."},
    )
    policy: str = field(
        default="least_outstanding",
        metadata={"help": "Load-balancing policy.", "choices": POLICIES},
    )
    max_retries: int = field(
        default=3,
        metadata={"help": "Extra attempts, each on another engine, before a request fails."},
    )
    request_timeout_s: float = field(
        default=600.0, metadata={"help": "Total timeout of one forwarded engine request."}
    )
    hot_path_client: str = field(
        default="http1",
        metadata={
            "help": "Client of forwarded POSTs (bench/router_overhead.py measures both).",
            "choices": ("http1", "aiohttp"),
        },
    )
    health_interval_s: float = field(
        default=1.0, metadata={"help": "Seconds between health checks (GET /model_info)."}
    )
    health_timeout_s: float = field(default=2.0, metadata={"help": "Timeout of one health check."})
    health_failures: int = field(
        default=3,
        metadata={"help": "Consecutive failed checks that evict an engine from the rotation."},
    )
    broker_url: str = field(
        default="",
        metadata={
            "help": "Weight broker base URL: an engine added at run time (or found restarted) "
            "is registered there to be brought to the current weights before it gets traffic."
        },
    )
    broker_retry_s: float = field(
        default=30.0,
        metadata={
            "help": "Seconds an engine may serve an older weight version than the others (its "
            "sync failed) before it is taken out and registered with the broker again; also how "
            "often an engine still waiting for its version is registered again."
        },
    )

    def validate(self) -> None:
        if self.max_retries < 0:
            raise ValueError("--max-retries must be >= 0")
        if self.health_interval_s <= 0 or self.health_failures < 1:
            raise ValueError("--health-interval-s must be > 0 and --health-failures >= 1")
        if self.broker_retry_s <= 0:
            raise ValueError("--broker-retry-s must be > 0")


@dataclass
class RolloutConfig:
    """How many samples the rollout loop makes per batch and how far ahead of the trainer."""

    rollout: bool = field(
        default=True, metadata={"help": "Run the rollout loop (--no-rollout: only route)."}
    )
    model: str = field(
        default="",
        metadata={"help": "Hugging Face model directory; its tokenizer encodes the prompts."},
    )
    rollout_batch_size: int = field(
        default=64,
        metadata={"help": "Groups (prompts) per rollout: what the trainer trains on per rollout."},
    )
    n_samples_per_prompt: int = field(
        default=8, metadata={"help": "Samples per prompt (the GRPO group size)."}
    )
    num_steps_per_rollout: int = field(
        default=1,
        metadata={"help": "Optimizer steps the trainer takes per rollout (same as the trainer's)."},
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "A group the trainer trains at version t is generated with weights of "
            "version >= t - max_staleness."
        },
    )
    rollout_max_concurrency: int = field(
        default=0,
        metadata={
            "help": "Most groups, and most /generate requests, the rollout keeps in flight "
            "(0 = rollout_batch_size groups, requests unbounded)."
        },
    )
    seed: int = field(
        default=1234,
        metadata={"help": "Seed of prompt sampling and of each request's sampling_seed."},
    )
    eval_interval: int = field(
        default=1,
        metadata={"help": "Evaluate held-out prompts every this many versions (0 = never)."},
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={"help": "Drop groups whose rewards are all equal; others replace them (DAPO)."},
    )
    partial_rollout: bool = field(
        default=False,
        metadata={"help": "Continue aborted samples from their partial tokens on new weights."},
    )
    max_continues: int = field(
        default=4,
        metadata={"help": "Times one sample may be aborted and continued (or restarted)."},
    )
    version_poll_s: float = field(
        default=0.05,
        metadata={"help": "How often a waiting rollout re-reads the engines' weight version."},
    )
    max_buffer_depth: int = field(
        default=-1,
        metadata={
            "help": "Most groups put and not yet consumed by the trainer; rollouts and agent "
            "sessions wait at it (-1 = 4 rollout batches; 0 = unbounded)."
        },
    )

    def buffer_depth_bound(self) -> int:
        """The backlog producers wait at, in groups (0 = unbounded)."""
        if self.max_buffer_depth < 0:
            return DEFAULT_DEPTH_BATCHES * self.rollout_batch_size
        return self.max_buffer_depth

    def staleness_reach(self) -> int:
        """Most groups the demand gate lets rollouts run ahead of the trainer (in flight
        included): the trainer's rollout and the ceil(s / k) after it (progress.py)."""
        ahead = -(-self.max_staleness // self.num_steps_per_rollout)
        return (ahead + 1) * self.rollout_batch_size

    def validate(self, model: bool = True) -> None:
        """ValueError naming the flag to change; `model`: check the model's folder too."""
        if model and self.rollout and not self.model:
            raise ValueError("--model is required for rollouts (or pass --no-rollout)")
        if model and self.model and not Path(self.model).is_dir():
            raise ValueError(f"--model {self.model}: not a directory (expected a HF model dir)")
        if model and self.model:  # the engines serve this model: refuse what none runs
            check_model_config(*read_config(self.model))
        if self.rollout_batch_size < 1 or self.n_samples_per_prompt < 1:
            raise ValueError("--rollout-batch-size and --n-samples-per-prompt must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("--max-staleness must be >= 0")
        if self.rollout_max_concurrency < 0:
            raise ValueError("--rollout-max-concurrency must be >= 0")
        if self.num_steps_per_rollout < 1:
            raise ValueError("--num-steps-per-rollout must be >= 1")
        check_buffer_depth(self.buffer_depth_bound(), self.rollout_batch_size)

    def contract(self) -> RunContract:
        """The run-contract terms this router states: the batch arithmetic and staleness when
        it runs rollouts; with --no-rollout (agents only) the model and the group size."""
        model_id = model_identity(self.model) if self.model else None
        if not self.rollout:
            return RunContract(model_id=model_id, n_samples_per_prompt=self.n_samples_per_prompt)
        return RunContract(
            model_id=model_id,
            rollout_batch_size=self.rollout_batch_size,
            n_samples_per_prompt=self.n_samples_per_prompt,
            num_steps_per_rollout=self.num_steps_per_rollout,
            max_staleness=self.max_staleness,
        )


@dataclass
class SamplingConfig:
    """Sampling parameters of rollout requests (evaluation is greedy)."""

    rollout_max_response_len: int = field(
        default=0,
        metadata={
            "help": "max_new_tokens of each rollout sample and evaluation answer (0 = the "
            "task's: 4 for the toy task, 1024 for a dataset or an environment)."
        },
    )
    rollout_temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature of rollouts."}
    )
    rollout_top_p: float = field(default=1.0, metadata={"help": "top_p of rollouts."})
    rollout_top_k: int = field(default=-1, metadata={"help": "top_k of rollouts (-1 = all)."})
    return_routed_experts: bool = field(
        default=False,
        metadata={
            "help": "MoE models: ask engines for the experts each layer chose (SGLang's "
            "return_routed_experts; SGLang needs --enable-return-routed-experts) and carry them "
            "in each sample, for the trainer's --use-routing-replay."
        },
    )
    rollout_stop: list[str] = field(
        default_factory=list,
        metadata={"help": "Stop strings of rollouts (a matched one ends the response text)."},
    )
    rollout_stop_token_ids: list[int] = field(
        default_factory=list,
        metadata={"help": "Stop token ids of rollouts (the tokenizer's EOS is always added)."},
    )

    def validate(self) -> None:
        if self.rollout_max_response_len < 0:
            raise ValueError("--rollout-max-response-len must be >= 1 (or 0: the task's)")
        if not 0 <= self.rollout_temperature < math.inf or not 0 < self.rollout_top_p <= 1:
            raise ValueError(
                "--rollout-temperature must be a finite number >= 0 and --rollout-top-p in (0, 1]"
            )
        if self.rollout_top_k < 1 and self.rollout_top_k != -1:  # (SGLang's own rule)
            raise ValueError(f"--rollout-top-k must be -1 (all) or >= 1, got {self.rollout_top_k}")
        if any(t < 0 for t in self.rollout_stop_token_ids):
            raise ValueError("--rollout-stop-token-ids must be token ids (>= 0)")


@dataclass
class DataConfig:
    """Where prompts come from (the built-in toy task when --prompt-data is empty)."""

    prompt_data: str = field(
        default="",
        metadata={
            "help": "Training prompts: JSON lines, a JSON array or .parquet (empty = toy task)."
        },
    )
    eval_prompt_data: str = field(
        default="", metadata={"help": "Held-out prompts for evaluation, as --prompt-data."}
    )
    eval_heldout_fraction: float = field(
        default=0.05,
        metadata={
            "help": "Without --eval-prompt-data: hold this fraction of --prompt-data out of "
            "training (at least one prompt, chosen by --task-seed) for evaluation; 0 = none."
        },
    )
    eval_max_prompts: int = field(
        default=500,
        metadata={
            "help": "Held-out prompts evaluated at most (a fixed subset chosen by --task-seed, "
            "of --eval-prompt-data or of the fraction held out; 0 = all): every evaluation "
            "takes engine time from rollouts, at each new version by default."
        },
    )
    input_key: str = field(default="prompt", metadata={"help": "Field holding the prompt."})
    label_key: str = field(default="label", metadata={"help": "Field holding the label."})
    apply_chat_template: bool = field(
        default=False,
        metadata={
            "help": "Wrap --prompt-data's text prompts in the chat template (message lists "
            "always are; the toy task's prompts are its own)."
        },
    )
    task_seed: int = field(
        default=1234, metadata={"help": "Seed of the train/held-out split (toy task, dataset)."}
    )
    apply_chat_template_kwargs: str = field(
        default="",
        metadata={
            "help": "Variables for the chat template, a JSON object, in every prompt the router "
            "renders: dataset rows, environment observations, agent session turns (a turn's "
            "own chat_template_kwargs add to them); e.g. '{\"enable_thinking\": false}' "
            "(Qwen3)."
        },
    )

    def template_kwargs(self) -> dict[str, Any]:
        """--apply-chat-template-kwargs as a dict; ValueError naming the flag."""
        if not self.apply_chat_template_kwargs:
            return {}
        try:
            value = json.loads(self.apply_chat_template_kwargs)
        except ValueError as exc:
            raise ValueError(f"--apply-chat-template-kwargs: not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError("--apply-chat-template-kwargs must be a JSON object")
        return value


@dataclass
class RewardConfig:
    """How a response is scored: one of --rm-type, --custom-rm-path, --rm-url."""

    rm_type: str = field(
        default="",
        metadata={
            "help": "Built-in verifier (default: the toy task's, reverse_digits; with "
            "--prompt-data, choose one, or --custom-rm-path or --rm-url).",
            "choices": ("", "reverse_digits", "exact_match", "last_number", "boxed"),
        },
    )
    custom_rm_path: str = field(
        default="",
        metadata={
            "help": "Reward function `fn(text, label, stopped)`: `module:fn`, or a file "
            "`path/to/reward.py:fn`; both looked up from the current directory."
        },
    )
    rm_url: str = field(default="", metadata={"help": "Remote reward service URL (POST)."})
    rm_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "Timeout of one reward call: to --rm-url, or of a --custom-rm-path function "
            "(in --rm-workers processes, or async); a call that overruns it drops its sample as "
            "reward_error."
        },
    )
    rm_workers: int = field(
        default=-1,
        metadata={
            "help": "Processes that run a --custom-rm-path function (not async) beside the "
            "router's event loop, one call each at a time, started as calls need them; a call "
            "past --rm-timeout-s has its process killed and replaced. -1 = one per CPU core, "
            "up to 8; 0 = in the event loop itself: only for a function that takes "
            "microseconds (a slow or hung one holds up the whole router)."
        },
    )
    rm_retries: int = field(default=2, metadata={"help": "Retries of a failed remote call."})
    rm_max_errors_in_a_row: int = field(
        default=256,
        metadata={
            "help": "A --custom-rm-path function that fails (raises, returns None or NaN, "
            "overruns --rm-timeout-s) on this many samples in a row stops the rollout with its "
            "last error, rather than dropping every group of the run (0 = never stop)."
        },
    )

    def validate(self, env_url: str = "") -> None:
        ways = ("rm_type", "custom_rm_path", "rm_url")  # (one was taken over the others)
        given = [f"--{k.replace('_', '-')} {getattr(self, k)}" for k in ways if getattr(self, k)]
        given += [f"--env-url {env_url} (its /step rewards)"] if env_url else []
        if len(given) > 1:
            raise ValueError(f"give one reward, not {' and '.join(given)}")
        if self.rm_timeout_s <= 0 or self.rm_workers < -1 or self.rm_retries < 0:
            raise ValueError("--rm-timeout-s must be > 0, --rm-workers >= -1, --rm-retries >= 0")
        if self.rm_max_errors_in_a_row < 0:
            raise ValueError(
                f"--rm-max-errors-in-a-row must be >= 0 (0 = never stop), got "
                f"{self.rm_max_errors_in_a_row}"
            )

    def reward_workers(self) -> int:
        """--rm-workers resolved: -1 is one per CPU core, up to 8."""
        return min(os.cpu_count() or 1, 8) if self.rm_workers < 0 else self.rm_workers


@dataclass
class EnvConfig:
    """An agent environment served over HTTP (docs/protocols.md has the protocol)."""

    env_url: str = field(
        default="", metadata={"help": "Environment server; rollouts become episodes when set."}
    )
    env_max_turns: int = field(default=8, metadata={"help": "Model turns per episode at most."})
    env_call_timeout_s: float = field(
        default=10.0, metadata={"help": "Timeout of one /reset or /step call."}
    )
    env_episode_timeout_s: float = field(
        default=120.0, metadata={"help": "Deadline of a whole episode."}
    )
    env_tool_call_parser: str = field(
        default="hermes",
        metadata={
            "help": "How tool calls are read from a model turn and sent to /step as "
            "`tool_calls` (hermes: <tool_call>{json}</tool_call>; none: the text only).",
            "choices": tuple(TOOL_CALL_PARSERS),
        },
    )


@dataclass
class SessionConfig:
    """Agent sessions: an agent calls /v1/chat/completions, then posts its reward."""

    max_sessions: int = field(
        default=10_000, metadata={"help": "Most open sessions; the oldest beyond it expire."}
    )
    session_ttl_s: float = field(
        default=3600.0, metadata={"help": "A session without a reward expires after this."}
    )
    session_max_new_tokens: int = field(
        default=1024, metadata={"help": "max_tokens of a chat turn when the agent sets none."}
    )
    session_put_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "How long a reward waits for room in a full buffer (--max-buffer-depth) "
            "before it is answered 503 with Retry-After (the session stays open)."
        },
    )
    session_tool_call_parser: str = field(
        default="hermes",
        metadata={
            "help": "How a session turn's tool calls are read from its text into the answer's "
            "`tool_calls` when the request lists `tools` (hermes: <tool_call>{json}</tool_call>; "
            "none: the text only). The trained tokens are the generated ones either way.",
            "choices": tuple(TOOL_CALL_PARSERS),
        },
    )


@dataclass
class RouterConfig:
    """Everything `tandem router` needs."""

    workers: WorkerPoolConfig = field(default_factory=WorkerPoolConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    api_token: str = field(
        default="",
        metadata={
            "help": "Bearer token required by mutating endpoints (empty = none); prefer the "
            "env TANDEM_ROUTER_TOKEN, since flags show in `ps`."
        },
    )

    def validate(self, model: bool = True) -> None:
        """ValueError naming the flag to change (`model`: the model's folder too; tandem up
        checks the rest before anything starts, when the toy model is not yet written)."""
        self.workers.validate()
        self.rollout.validate(model)
        self.sampling.validate()
        if model and self.rollout.rollout and self.rollout.model:
            check_response_len(self.rollout.model, self.sampling.rollout_max_response_len)
        self.reward.validate(self.env.env_url)
        self.buffer.validate()
        if problem := reward_problem(self.data.prompt_data, self.scored()):
            raise ValueError(problem)
        self.data.template_kwargs()
        if self.data.eval_max_prompts < 0 or not 0 <= self.data.eval_heldout_fraction < 1:
            raise ValueError(
                "--eval-max-prompts must be >= 0 and --eval-heldout-fraction within [0, 1)"
            )

    def scored(self) -> bool:
        """A reward was chosen (or an environment gives them): not the toy task's default."""
        r = self.reward
        return bool(r.rm_type or r.custom_rm_path or r.rm_url or self.env.env_url)


def reward_problem(prompt_data: str, scored: bool) -> str:
    """Why a dataset's run has no reward (`scored`: a reward flag or an environment is set):
    the default verifier is the toy task's (it scores the first two characters of a reversed
    pair), not one for your prompts. "" when it has one."""
    if not prompt_data or scored:
        return ""
    return (
        f"--prompt-data {prompt_data}: choose how its responses are scored: --rm-type "
        "exact_match|last_number|boxed, --custom-rm-path FILE.py:fn, or the router's --rm-url "
        "(the default, reverse_digits, is the toy task's verifier)"
    )
