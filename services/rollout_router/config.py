"""The router's configuration: one typed tree with a section per component.

`run` holds the run's shared terms (proto/run_terms.py: model, seed, batch terms, staleness,
Redis), `workers` goes to the worker pool (balancing, health, retries), `rollout` and
`sampling` to the rollout loop (the settings `PATCH /rollout/config` may change live), `data`,
`reward`, `env` and `sessions` to the task, the reward, environment episodes and agent sessions,
`buffer` to the Redis sample buffer, `serve` to the HTTP server. Flag names follow slime where
the concept is the same (`--rollout-batch-size`, `--n-samples-per-prompt`,
`--rollout-max-response-len`, `--rollout-temperature`). Ranges are in the field types;
`RouterConfig.validate` checks what spans fields, `check` what reads files or imports user code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from proto.run_terms import RunContract, RunTerms
from services.common.settings import Count, PositiveSeconds, Seconds, Section, ServeSection, unless
from services.rollout_router.config_checks import DEFAULT_DEPTH_BATCHES, check_buffer_depth
from services.sample_buffer import BufferConfig, BufferLimits

ToolCallParser = Literal["hermes", "none"]  # gateway/tool_calls.py's PARSERS


class WorkerPoolConfig(Section):
    """Which engines to use and how to balance, health-check and retry across them."""

    engine_urls: list[str] = Field(default_factory=list)
    """Base URLs of SGLang-compatible engines (more can be added at run time)."""
    engine_wait_timeout_s: Seconds = 300.0
    """How long start-up waits for every engine's /model_info."""
    policy: Literal["least_outstanding", "round_robin", "session_affinity"] = "least_outstanding"
    """Load-balancing policy."""
    max_retries: Count = 3
    """Extra attempts, each on another engine, before a request fails."""
    request_timeout_s: Seconds = 600.0
    """Total timeout of one forwarded engine request."""
    hot_path_client: Literal["http1", "aiohttp"] = "http1"
    """Client of forwarded POSTs (bench/router_overhead.py measures both)."""
    health_interval_s: PositiveSeconds = 1.0
    """Seconds between health checks (GET /model_info)."""
    health_timeout_s: Seconds = 2.0
    """Timeout of one health check."""
    health_failures: Annotated[int, Field(ge=1)] = 3
    """Consecutive failed checks that evict an engine from the rotation."""
    stall_timeout_s: Seconds = 1.0
    """An engine holding requests that answers neither them nor GET /model_info for this long
    (stopped or hung) is taken out at once and its requests are sent to another engine, if one
    serves; 0: only --health-failures evicts."""
    broker_url: str = ""
    """Weight broker base URL: an engine added at run time (or found restarted) is registered
    there to be brought to the current weights before it gets traffic."""
    broker_retry_s: PositiveSeconds = 30.0
    """Seconds an engine may serve an older weight version than the others (its sync failed)
    before it is taken out and registered with the broker again; also how often an engine still
    waiting for its version is registered again."""


class RolloutConfig(Section):
    """How far ahead of the trainer the rollout loop runs, and what it does with groups (the
    batch terms and staleness are the run's: `RouterConfig.run`)."""

    rollout: bool = True
    """Run the rollout loop (--no-rollout: only route)."""
    rollout_max_concurrency: Count = 0
    """Most groups, and most /generate requests, the rollout keeps in flight (0 =
    rollout_batch_size groups, requests unbounded)."""
    eval_interval: Count = 1
    """Evaluate held-out prompts every this many versions (0 = never)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal; others replace them (DAPO)."""
    partial_rollout: bool = False
    """Continue aborted samples from their partial tokens on new weights."""
    max_continues: Count = 4
    """Times one sample may be aborted and continued (or restarted)."""
    version_poll_s: PositiveSeconds = 0.05
    """How often a waiting rollout re-reads the engines' weight version."""
    max_buffer_depth: Annotated[int, Field(ge=-1)] = -1
    """Most groups put and not yet consumed by the trainer; rollouts and agent sessions wait at
    it (-1 = 4 rollout batches; 0 = unbounded)."""


def depth_bound(max_buffer_depth: int, batch: int) -> int:
    """The backlog producers wait at, in groups (0 = unbounded), for rollouts of `batch`."""
    return DEFAULT_DEPTH_BATCHES * batch if max_buffer_depth < 0 else max_buffer_depth


class SamplingConfig(Section):
    """Sampling parameters of rollout requests (evaluation is greedy)."""

    rollout_max_response_len: Count = 0
    """max_new_tokens of each rollout sample and evaluation answer (0 = the task's: 4 for the toy
    task, 1024 for a dataset or an environment)."""
    rollout_temperature: Annotated[float, Field(ge=0)] = 1.0
    """Sampling temperature of rollouts."""
    rollout_top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """top_p of rollouts."""
    rollout_top_k: Annotated[int, Field(ge=-1), unless(-1, "all", 1)] = -1
    """top_k of rollouts (-1 = all; not 0: SGLang's rule)."""
    return_routed_experts: bool = False
    """MoE models: ask engines for the experts each layer chose (SGLang's return_routed_experts;
    SGLang needs --enable-return-routed-experts) and carry them in each sample, for the
    trainer's --use-routing-replay."""
    rollout_stop: list[str] = Field(default_factory=list)
    """Stop strings of rollouts (a matched one ends the response text)."""
    rollout_stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """Stop token ids of rollouts (the tokenizer's EOS is always added)."""


class DataConfig(Section):
    """Where prompts come from (the built-in toy task when --prompt-data is empty)."""

    prompt_data: str = ""
    """Training prompts: JSON lines, a JSON array or .parquet (empty = toy task)."""
    eval_prompt_data: str = ""
    """Held-out prompts for evaluation, as --prompt-data."""
    eval_heldout_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.05
    """Without --eval-prompt-data: hold this fraction of --prompt-data out of training (at least
    one prompt, chosen by --task-seed) for evaluation; 0 = none."""
    eval_max_prompts: Count = 500
    """Held-out prompts evaluated at most (a fixed subset chosen by --task-seed, of
    --eval-prompt-data or of the fraction held out; 0 = all): every evaluation takes engine time
    from rollouts, at each new version by default."""
    input_key: str = "prompt"
    """Field holding the prompt."""
    label_key: str = "label"
    """Field holding the label."""
    apply_chat_template: bool = False
    """Wrap --prompt-data's text prompts in the chat template (message lists always are; the toy
    task's prompts are its own)."""
    task_seed: int = 1234
    """Seed of the train/held-out split (toy task, dataset)."""
    apply_chat_template_kwargs: str = ""
    """Variables for the chat template, a JSON object, in every prompt the router renders:
    dataset rows, environment observations, agent session turns (a turn's own
    chat_template_kwargs add to them); e.g. '{"enable_thinking": false}' (Qwen3)."""

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


class RewardConfig(Section):
    """How a response is scored: one of --rm-type, --custom-rm-path, --rm-url."""

    rm_type: Literal["", "reverse_digits", "exact_match", "last_number", "boxed"] = ""
    """Built-in verifier (default: the toy task's, reverse_digits; with --prompt-data, choose
    one, or --custom-rm-path or --rm-url)."""
    custom_rm_path: str = ""
    """Reward function `fn(text, label, stopped)`: `module:fn`, or a file `path/to/reward.py:fn`;
    both looked up from the current directory."""
    rm_url: str = ""
    """Remote reward service URL (POST)."""
    rm_timeout_s: PositiveSeconds = 30.0
    """Timeout of one reward call: to --rm-url, or of a --custom-rm-path function (in
    --rm-workers processes, or async); a call that overruns it drops its sample as
    reward_error."""
    rm_workers: Annotated[int, Field(ge=-1)] = -1
    """Processes that run a --custom-rm-path function (not async) beside the router's event
    loop, one call each at a time, started as calls need them; a call past --rm-timeout-s has
    its process killed and replaced. -1 = one per CPU core, up to 8; 0 = in the event loop
    itself: only for a function that takes microseconds (a slow or hung one holds up the whole
    router)."""
    rm_retries: Count = 2
    """Retries of a failed remote call."""
    rm_max_errors_in_a_row: Count = 256
    """A --custom-rm-path function that fails (raises, returns None or NaN, overruns
    --rm-timeout-s) on this many samples in a row stops the rollout with its last error, rather
    than dropping every group of the run (0 = never stop)."""

    def reward_workers(self) -> int:
        """--rm-workers resolved: -1 is one per CPU core, up to 8."""
        return min(os.cpu_count() or 1, 8) if self.rm_workers < 0 else self.rm_workers


class EnvConfig(Section):
    """An agent environment served over HTTP (docs/protocols.md has the protocol)."""

    env_url: str = ""
    """Environment server; rollouts become episodes when set."""
    env_max_turns: Count = 8
    """Model turns per episode at most."""
    env_call_timeout_s: Seconds = 10.0
    """Timeout of one /reset or /step call."""
    env_episode_timeout_s: Seconds = 120.0
    """Deadline of a whole episode."""
    env_tool_call_parser: ToolCallParser = "hermes"
    """How tool calls are read from a model turn and sent to /step as `tool_calls` (hermes:
    <tool_call>{json}</tool_call>; none: the text only)."""


class SessionConfig(Section):
    """Agent sessions: an agent calls /v1/chat/completions, then posts its reward."""

    max_sessions: Count = 10_000
    """Most open sessions; the oldest beyond it expire."""
    session_ttl_s: Seconds = 3600.0
    """A session without a reward expires after this."""
    session_max_new_tokens: Count = 1024
    """max_tokens of a chat turn when the agent sets none."""
    session_put_timeout_s: Seconds = 30.0
    """How long a reward waits for room in a full buffer (--max-buffer-depth) before it is
    answered 503 with Retry-After (the session stays open)."""
    session_tool_call_parser: ToolCallParser = "hermes"
    """How a session turn's tool calls are read from its text into the answer's `tool_calls`
    when the request lists `tools` (hermes: <tool_call>{json}</tool_call>; none: the text only).
    The trained tokens are the generated ones either way."""


class RouterConfig(Section):
    """Configuration of `tandem router`."""

    run: RunTerms = RunTerms()
    workers: WorkerPoolConfig = WorkerPoolConfig()
    rollout: RolloutConfig = RolloutConfig()
    sampling: SamplingConfig = SamplingConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    env: EnvConfig = EnvConfig()
    sessions: SessionConfig = SessionConfig()
    buffer: BufferLimits = BufferLimits()
    # long agent conversations, batched prompts
    serve: ServeSection = ServeSection(port=30000, max_request_bytes=16 << 20)
    api_token: str = ""
    """Bearer token required by mutating endpoints (empty = none); prefer the env
    TANDEM_ROUTER_TOKEN, since flags show in `ps`."""
    log_level: str = "INFO"
    """Python log level."""

    def validate(self) -> None:  # type: ignore[override]  # (pydantic's is a deprecated classmethod)
        """ValueError naming the flag to change, for what spans fields (files: `check`)."""
        if self.rollout.rollout and not self.run.model:
            raise ValueError("--model is required for rollouts (or pass --no-rollout)")
        reward = self.reward
        ways = ("rm_type", "custom_rm_path", "rm_url")  # (one was taken over the others)
        given = [
            f"--{k.replace('_', '-')} {getattr(reward, k)}" for k in ways if getattr(reward, k)
        ]
        given += [f"--env-url {self.env.env_url} (its /step rewards)"] if self.env.env_url else []
        if len(given) > 1:
            raise ValueError(f"give one reward, not {' and '.join(given)}")
        self.buffer_config().validate()
        if problem := reward_problem(self.data.prompt_data, self.scored()):
            raise ValueError(problem)
        self.data.template_kwargs()
        check_buffer_depth(self.buffer_depth_bound(), self.run.rollout_batch_size)

    def scored(self) -> bool:
        """A reward was chosen (or an environment gives them): not the toy task's default."""
        r = self.reward
        return bool(r.rm_type or r.custom_rm_path or r.rm_url or self.env.env_url)

    def buffer_config(self) -> BufferConfig:
        """The sample buffer's: the run's Redis and id, this router's log lengths."""
        return BufferConfig(self.run.redis_url, self.run.run_id, **self.buffer.model_dump())

    def buffer_depth_bound(self) -> int:
        """The backlog producers wait at, in groups (0 = unbounded)."""
        return depth_bound(self.rollout.max_buffer_depth, self.run.rollout_batch_size)

    def staleness_reach(self) -> int:
        """Most groups the demand gate lets rollouts run ahead of the trainer (in flight
        included): the trainer's rollout and the ceil(s / k) after it (progress.py)."""
        run = self.run
        ahead = -(-run.max_staleness // run.num_steps_per_rollout)
        return (ahead + 1) * run.rollout_batch_size

    def contract(self) -> RunContract:
        """The run-contract terms this router states: the batch arithmetic and staleness when
        it runs rollouts; with --no-rollout (agents only) the model and the group size."""
        if not self.rollout.rollout:
            return self.run.contract("model", "n_samples_per_prompt")
        return self.run.contract(*AGREED_BY_ROUTER)


AGREED_BY_ROUTER = (
    "model",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "num_steps_per_rollout",
    "max_staleness",
    "seed",  # the prompt order
)


# The live sections PATCH /rollout/config may change, and their fields it may not: the loop's
# switch, what only start-up reads (the poll interval, the depth bound, the template variables).
LIVE_SECTIONS: dict[str, type[Section]] = {
    "rollout": RolloutConfig,
    "sampling": SamplingConfig,
    "data": DataConfig,
}
FROZEN = {"rollout", "version_poll_s", "max_buffer_depth", "apply_chat_template_kwargs"}
# Their types where a live value's range is narrower: 0, the task's length, is resolved at start.
LIVE_TYPES: dict[str, Any] = {"rollout_max_response_len": Annotated[int, Field(ge=1)]}


def _optional(name: str, info: Any) -> Any:
    kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return (LIVE_TYPES.get(name, kind) | None, Field(None, description=info.description))


if TYPE_CHECKING:
    RolloutPatch = BaseModel
else:
    RolloutPatch = create_model(
        "RolloutPatch",
        __config__=ConfigDict(extra="forbid", allow_inf_nan=False),
        __doc__="A change of the live rollout, sampling and data settings (`PATCH /rollout/config`):"
        " the fields of those sections that may change while the router runs, each optional; the"
        " run's terms are none of them (restart the run to change one).",
        **{
            name: _optional(name, info)
            for section in LIVE_SECTIONS.values()
            for name, info in section.model_fields.items()
            if name not in FROZEN
        },
    )


def patches_key(run_id: str) -> str:
    """The run's Redis list of accepted `PATCH /rollout/config` changes, oldest first, each a
    JSON record {time, version (the trainer's), fields, over}: `over` holds the values the
    accepting router was started with for those fields. The run's one record of them: a router
    started on the run re-applies them (`patches_in_force`); `tandem up` copies it to
    RUN_DIR/patches.jsonl. In Redis, not a file, because a router may run apart from any run
    folder, and the run's Redis is what a restarted router and a resume find again."""
    return f"tandem:{run_id}:patches"


def patches_in_force(
    records: list[dict[str, Any]], configured: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """What a router started with the live settings `configured` re-applies of the run's PATCH
    `records`: (the fields to set, {field: (patched, configured)} for those its start
    overrides). A field's last PATCH holds while a start gives the value that PATCH changed;
    a start given another one (a flag of `tandem up --resume`, a changed file) wins over it."""
    latest: dict[str, Any] = {}
    over: dict[str, Any] = {}
    for record in records:
        if record.get("by", "").startswith("refused"):  # (a start could not re-apply them)
            continue
        latest |= record["fields"]
        over |= {key: record["over"].get(key) for key in record["fields"]}
    apply, overridden = {}, {}
    for key, value in latest.items():
        if configured.get(key) != over[key]:
            overridden[key] = (value, configured.get(key))
        elif value != configured.get(key):
            apply[key] = value
    return apply, overridden


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


def check(config: RouterConfig) -> list[str]:
    """The start-up checks that read files or look up user code, each problem naming the flag
    to fix: the model's folder (a model type the engines run, a response bound under its
    context), the data files' first rows, the custom reward's module or file. (Imports stay
    inside: `tandem up` imports this module.)"""
    from proto.models import check_model_config, read_config
    from services.rollout_router.config_checks import check_response_len
    from services.rollout_router.rollout.custom_reward import import_problem
    from services.rollout_router.rollout.tasks import data_problem

    problems, model, data = [], config.run.model, config.data
    try:
        if model and not Path(model).is_dir():
            problems.append(f"--model {model}: not a directory (expected a HF model dir)")
        elif model:  # the engines serve this model: refuse what none runs
            check_model_config(*read_config(model))
            if config.rollout.rollout:
                check_response_len(model, config.sampling.rollout_max_response_len)
    except ValueError as exc:
        problems.append(str(exc))
    for path, flag in (
        (data.prompt_data, "--prompt-data"),
        (data.eval_prompt_data, "--eval-prompt-data"),
    ):
        if problem := data_problem(path, flag, data.input_key):
            problems.append(problem)
    if config.reward.custom_rm_path and (problem := import_problem(config.reward.custom_rm_path)):
        problems.append(problem)
    return problems
