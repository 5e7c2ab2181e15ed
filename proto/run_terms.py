"""The run terms: what router, trainer and broker of one run share, declared once.

`RunTerms` is a config section: router and trainer configs embed it as their `run` field (flags
`--run-id`, `--redis-url`, `--model`, `--seed`, `--rollout-batch-size`, `--n-samples-per-prompt`,
`--num-steps-per-rollout`, `--max-staleness`, `--weight-transport`; keys of the same names in a
TOML table; `TANDEM_<SVC>_<KEY>` variables), and `tandem up` fills one `RunTerms` into each
child's config. The broker embeds `RunPlace`, its first two fields (run id and Redis URL):
it states only how weights arrive, from its own --transport. Ranges are in the field types.

The agreed terms (`AGREED`) are also checked in Redis while the run lives: the first service that
starts writes each term it states (its run membership, `Membership.agree`, through
`SampleBuffer.agree_contract`: hash `tandem:{run_id}:contract`, one field per term, JSON values),
and every other checks its own against them. A service states only the terms it knows
(`RunTerms.contract(*terms)`; the rest stay None, "not mine to say");
a term another service stated differently is a `ContractMismatchError` naming both values, who set
the first one, and the flag to change. `RunContract`, that statement, is made from `AGREED`
(not declared again): the model is stated as `model_id`, `model_identity(--model)`, so the same
checkpoint under different paths (a container mount, another host) is the same model.
Who states what: router and trainer the batch terms, `max_staleness`, the model and the seed
(it orders the prompts: a router restarted with another drew some prompts of the epoch twice
and others never; a router with --no-rollout: the model and the group size); trainer and
broker `weight_transport`; the router alone `data`, the training prompts the seed orders (their
count and a digest of them as tokenized, in order: `RunTerms` does not hold it, the router
states it once its prompts are loaded; a router restarted on other prompts would draw the run's
next prompts from another list).
`PATCH /rollout/config` cannot change a run term (its body type has none).

Knows pydantic and msgspec; nothing of services, Redis or files beyond the model's config.json.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

# The terms checked in Redis, in the order they are checked.
AGREED = (
    "model",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "num_steps_per_rollout",
    "max_staleness",
    "weight_transport",
    "seed",
    "data",
)


class RunPlace(BaseModel):
    """Which run, in which Redis: the terms of a service that uses no others (the broker)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    run_id: str = "default"
    """Run id: key prefix of this run in Redis (one run per id)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL of the run's sample buffer."""


class RunTerms(RunPlace):
    """The run's shared terms; one section, embedded as `run` by the router's and the trainer's
    configs (the broker's embeds its `RunPlace` part)."""

    model: str = ""
    """Hugging Face model directory (config.json + *.safetensors): the trainer starts from it,
    the router's tokenizer encodes the prompts with it."""
    seed: int = 1234
    """Seed of the run: the router's prompt sampling and each request's sampling_seed, the
    trainer's RNGs."""
    rollout_batch_size: Annotated[int, Field(ge=1)] = 64
    """Groups (prompts) per rollout; one rollout feeds num_steps_per_rollout optimizer steps."""
    n_samples_per_prompt: Annotated[int, Field(ge=1)] = 8
    """Samples per prompt (the GRPO group size)."""
    num_steps_per_rollout: Annotated[int, Field(ge=1)] = 1
    """Optimizer steps per rollout (global batch = rollout samples / this)."""
    max_staleness: Annotated[int, Field(ge=0)] = 1
    """A group the trainer trains at version t was generated with weights of version >=
    t - max_staleness; older groups are dropped (and counted)."""
    weight_transport: Literal["zmq", "nccl"] = "zmq"
    """How weights leave the trainer: zmq (buckets pushed to the broker) or nccl (the broker has
    engines join a weight group and the trainer's rank 0 broadcasts; gloo when training on CPU).
    Must match the broker's --transport."""

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step."""
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        return samples // self.num_steps_per_rollout

    def contract(self, *terms: str) -> RunContract:
        """This service's statement of `terms` (names from `AGREED`; all when none are named)."""
        values: dict[str, Any] = {}
        for term in terms or AGREED:
            if term == "model":
                values["model_id"] = model_identity(self.model) if self.model else None
            else:
                values[term] = getattr(self, term, None)  # (`data`: the router's own)
        return RunContract(**values)


class ContractMismatchError(ValueError):
    """This service's terms contradict the run's; the message says what to change."""


class _Statement(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The base of `RunContract` (its fields: `AGREED`, the model as `model_id`)."""

    if TYPE_CHECKING:

        def __init__(self, **terms: Any) -> None: ...
        def __getattr__(self, term: str) -> Any: ...

    def terms(self) -> dict[str, object]:
        """The terms this service states."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    @property
    def global_batch_samples(self) -> int | None:
        """Samples per optimizer step, when the batch terms are known."""
        batch = [getattr(self, t) for t in AGREED[1:4]]
        return None if None in batch else batch[0] * batch[1] // batch[2]


TEXT_TERMS = ("model", "weight_transport", "data")  # the others are numbers


def _term(name: str) -> str:
    return "model_id" if name == "model" else name


# One service's statement of the run's agreed terms; None = this service does not set it.
# Sent by router, trainer and broker into Redis; read back by each of them and by `tandem up`.
if TYPE_CHECKING:
    RunContract = _Statement
else:
    RunContract = msgspec.defstruct(
        "RunContract",
        [(_term(n), str | None if n in TEXT_TERMS else int | None, None) for n in AGREED],
        bases=(_Statement,),
        module=__name__,
    )

# Term -> the command-line flag that sets it (the same name in every service).
FLAGS = {_term(n): "--" + n.replace("_", "-") for n in AGREED} | {
    "weight_transport": "--weight-transport (the broker's --transport)",
    "data": "--prompt-data (and --task-seed, --eval-heldout-fraction, --input-key, --label-key, "
    "--apply-chat-template: the prompts as tokenized)",
}


def model_identity(model_dir: str | Path) -> str:
    """`model_type` and a short hash of the HF directory's `config.json`."""
    path = Path(model_dir) / "config.json"
    raw = path.read_bytes()
    model_type = msgspec.json.decode(raw).get("model_type", "?")
    return f"{model_type}:{hashlib.sha256(raw).hexdigest()[:12]}"


def mismatch(term: str, stored: object, by: str, mine: object, who: str) -> str:
    """The one-line explanation of a contradicted term."""
    return (
        f"run contract: {term} is {stored!r} in this run (set by the {by}) but this {who} "
        f"was started with {mine!r}; start every service of the run with the same "
        f"{FLAGS.get(term, term)}, or use another --run-id for a new run"
    )
