"""The resolved configuration of a `tandem up` run, every table: what `tandem config show`
prints and what each run folder keeps as `config.toml`.

`[up]` is the launcher's configuration. `[router]`, `[trainer]`, `[broker]` and `[engine]` are
each service's settings as that service resolves them (the config file's table, then
`TANDEM_<SERVICE>_<KEY>` variables, then the flags `tandem up` gives it, `--*-args` last). A
setting that `tandem up` gives the service itself (from `[up]`, or per run: addresses, run id,
ready file) is written as a comment naming where it comes from, so that
`tandem up --config RUN_DIR/config.toml` repeats the run without contradicting itself, and a
table that sets such a key to another value is refused (set it in `[up]` instead).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.config_file import (
    ENV_PREFIX,
    ConfigError,
    env_values,
    layered_defaults,
    number_problem,
    number_rules,
    options,
    read_file,
    sources,
    to_toml,
)
from services.common.flags import config_from_args
from services.rollout_router.rollout.tasks import data_problem
from services.sample_buffer import SampleBuffer
from services.trainer.intake import limits_of
from tandem.supervisor import ChildFailedError
from tandem.up_args import ONE_TIME, PATH_KEYS, RENDERED, absolute_path, rendered
from tandem.up_services import service_args
from tandem.up_settings import UpConfig, build_parser


def _router() -> argparse.ArgumentParser:
    from services.rollout_router.__main__ import build_parser as router_parser

    return router_parser()


def _trainer() -> argparse.ArgumentParser:
    from services.trainer.__main__ import build_parser as trainer_parser

    return trainer_parser()


def _broker() -> argparse.ArgumentParser:
    from services.weight_broker.__main__ import build_parser as broker_parser

    return broker_parser()


def _engine() -> argparse.ArgumentParser:
    from services.engine.__main__ import build_parser as engine_parser

    return engine_parser()


PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "up": build_parser,
    "router": _router,
    "trainer": _trainer,
    "broker": _broker,
    "engine": _engine,
}
# Settings tandem up gives a service per run, once the other services are up.
WIRING = {
    "engine": {"ready_file"},
    "broker": {"engine_urls", "ready_file"},
    "router": {"engine_urls", "broker_url", "ready_file"},
    "trainer": {"weights_endpoint", "ready_file"},
}
RUN_CONFIG = "config.toml"


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser with errors raised as ConfigError instead of exiting."""

    def error(message: str) -> Any:
        raise ConfigError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def _dests(parser: argparse.ArgumentParser, args: list[str]) -> set[str]:
    """The settings `args` names."""
    named = {a.partition("=")[0] for a in args if a.startswith("--")}
    return {
        action.dest
        for flag, action in parser._option_string_actions.items()
        if flag in named and action.dest in options(parser)
    }


def service_table(
    name: str, own: list[str], extra: list[str], config_file: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """Service `name`'s resolved settings when tandem up runs it with its own flags `own`
    and the pass-through flags `extra`, and a note per setting tandem up gives it itself.
    Raises ConfigError for a bad table, a bad pass-through flag or a contradiction."""
    parser = _strict(PARSERS[name]())
    layered = layered_defaults(parser, name, config_file)
    managed = _dests(parser, own) | WIRING[name]
    ours = vars(_strict(PARSERS[name]()).parse_args(own))
    # A table tandem up wrote holds a setting it gives from [up] only where it left it to the
    # service (0, unset): [up] (or a flag over it, as beside --resume) settles it since.
    settled = managed - WIRING[name] - set(env_values(parser, name))
    for key in sorted(set(layered) & managed - (settled if rendered(config_file) else set())):
        if key in WIRING[name] or layered[key] != ours[key]:
            variable = f"{ENV_PREFIX}{name.upper()}_{key.upper()}"
            raise ConfigError(
                f"[{name}] {key} = {layered[key]!r} (config file or {variable}), but tandem up "
                f"gives the {name} {ours.get(key)!r} ({_origin(name, key)}): remove it there"
            )
    rules = number_rules(parser)  # (at the flags' own defaults)
    parser.set_defaults(**layered)
    try:
        values = vars(parser.parse_args(own + extra))
    except ConfigError as exc:  # only the pass-through flags can be unknown here
        raise ConfigError(f"--{name}-args: {exc}") from exc
    named = sources(parser, own + extra, name, config_file)
    if problem := number_problem(parser, argparse.Namespace(**values), rules, named):
        raise ConfigError(f"{name}: {problem}")  # (the service refused it once started)
    _check(name, values)
    table = {key: values[key] for key in options(parser)}
    for key in PATH_KEYS & table.keys():  # (a resume may run from another folder)
        table[key] = absolute_path(table[key])
    notes = {key: _origin(name, key) for key in managed}
    for key in table:
        if key.endswith("token") and table[key]:  # a secret stays out of the run folder
            table[key], notes[key] = "", "not recorded (a secret): give it again"
    for flag in ONE_TIME if name == "trainer" else ():  # (a resume reads this file again)
        key = flag.removeprefix("--").replace("-", "_")
        table[key], notes[key] = ours[key], "one launch's choice, not recorded: give it again"
    return table, notes


def _check(name: str, values: dict[str, Any]) -> None:
    """Each service's own checks of its resolved settings, before anything starts (they were
    refused only once Redis and the engines were up: minutes for a real model); ConfigError
    naming the service and the flag. The model's folder is checked when it is there (the toy
    model is written at the start)."""
    flags = argparse.Namespace(**values)
    try:
        if name == "router":
            from services.rollout_router.config import RouterConfig

            router = config_from_args(RouterConfig, flags)
            router.validate(model=Path(router.rollout.model).is_dir())
            # (--router-args or [router]: the file [up] names is checked with --prompt-data)
            data = router.data
            if problem := data_problem(data.eval_prompt_data, "--eval-prompt-data", data.input_key):
                raise ValueError(problem)
        elif name == "trainer":
            from services.trainer.config import TrainerConfig

            config_from_args(TrainerConfig, flags).validate()
        elif name == "engine":  # (--engine-args "--max-batch-size 0" failed each engine's start)
            from services.engine.config import EngineConfig

            engine = config_from_args(EngineConfig, flags)
            engine.validate() if Path(engine.model).is_dir() else engine.validate_numbers()
        elif name == "broker":
            from services.weight_broker.config import BrokerConfig

            config_from_args(BrokerConfig, flags).validate()
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def greedy_groups(router: dict[str, Any], trainer: dict[str, Any]) -> str:
    """Greedy rollouts (temperature 0, or top_k 1) give a group one response n times: a
    group-relative advantage is then 0 for every sample, and nothing is learned ("": fine)."""
    from services.trainer.config import GROUP_BASELINED

    greedy = router["rollout_temperature"] == 0 or router["rollout_top_k"] == 1
    estimator, n = trainer["advantage_estimator"], trainer["n_samples_per_prompt"]
    if not greedy or n < 2 or estimator not in GROUP_BASELINED:
        return ""
    how = "--rollout-temperature 0" if router["rollout_temperature"] == 0 else "--rollout-top-k 1"
    return (
        f"router: {how} samples greedily: the {n} samples of a prompt are one response, and "
        f"the trainer's --advantage-estimator {estimator} (reward minus the group's mean) gives "
        "each an advantage of 0: nothing would be learned; sample with a temperature > 0 "
        "(--router-args, or [router])"
    )


def unmeasured_goal(stop_accuracy: float, router: dict[str, Any]) -> str:
    """A held-out accuracy goal the router never measures ("" when it does, or no goal): the
    run said it would stop there and could only end at --max-steps."""
    if stop_accuracy <= 0:
        return ""
    held_out = router["eval_prompt_data"] or router["eval_heldout_fraction"] > 0
    if router["eval_interval"] == 0:
        why, fix = "the router's --eval-interval 0 never evaluates", "an --eval-interval"
    elif router["prompt_data"] and not held_out:
        why = "the router holds no prompts out (no --eval-prompt-data, --eval-heldout-fraction 0)"
        fix = "--eval-prompt-data"
    else:
        return ""
    return (
        f"--stop-accuracy {stop_accuracy:g} is a held-out accuracy goal, but {why}: the run "
        f"could only end at --max-steps; give {fix}, or --stop-accuracy 0 (no goal)"
    )


def world_problem(procs: int, trainer: dict[str, Any]) -> str:
    """Trainer processes that the tensor-parallel size does not divide ("" when it does):
    megatron's RuntimeError traceback once the trainer started, the engines up already."""
    tp = trainer["tensor_model_parallel_size"]
    if procs % tp == 0:
        return ""
    return (
        f"--trainer-procs {procs} is tensor-parallel x data-parallel, and the trainer's "
        f"--tensor-model-parallel-size {tp} does not divide it: give --trainer-procs a "
        f"multiple of {tp} (and as many --trainer-gpus)"
    )


UP_KEYS = {f.name for f in dataclasses.fields(UpConfig)}
UP_ALIASES = {("broker", "transport"): "weight_transport", ("engine", "device"): "engine_device"}


def _origin(service: str, key: str) -> str:
    """Where tandem up takes a setting it gives `service` from."""
    up_key = UP_ALIASES.get((service, key), key if key in UP_KEYS else "")
    return f"set by tandem up from [up] {up_key}" if up_key else "set by tandem up per run"


def render(
    config: UpConfig,
    config_file: str,
    model: Path | None = None,
    redis_url: str = "",
    run_id: str = "up-RUN",
    run_dir: Path = Path("RUN_DIR"),
) -> str:
    """The whole resolved configuration as TOML (see the module docstring); ConfigError when
    a table contradicts [up] or a pass-through flag is unknown to its service."""
    model = model or Path(config.model or "RUN_DIR/model")
    redis_url = redis_url or config.redis_url or "redis://STARTED-BY-TANDEM-UP"
    own = service_args(config, run_id, model, redis_url, run_dir, passthrough=False)
    own["broker"] = service_args(config, run_id, model, redis_url, run_dir)["broker"]
    full = service_args(config, run_id, model, redis_url, run_dir)
    up = {key: getattr(config, key) for key in options(build_parser())}
    up.update(resume="", run_dir="")  # a repeat is a new run, in a new folder
    tables: dict[str, dict[str, Any]] = {"up": up}
    notes: dict[str, dict[str, str]] = {}
    for name in ("router", "trainer", "broker", "engine"):
        extra = full[name][len(own[name]) :]
        tables[name], notes[name] = service_table(name, own[name][1:], extra, config_file)
    goal = unmeasured_goal(config.by_model("stop_accuracy"), tables["router"])
    goal = goal or world_problem(config.trainer_procs, tables["trainer"])
    if problem := greedy_groups(tables["router"], tables["trainer"]) or goal:
        raise ConfigError(problem)
    header = (
        f"{RENDERED}: the configuration of this run, every service.\n"
        "# Repeat it: tandem up --config THIS_FILE (flags given beside it override it).\n"
        "# Commented keys are set by tandem up itself; change them in [up].\n\n"
    )
    return header + to_toml(tables, notes)


def write_run_config(run_dir: Path, text: str) -> Path:
    path = (run_dir / RUN_CONFIG).resolve()
    path.write_text(text)
    return path


def state_trainer_limits(buffer: SampleBuffer, recorded: Path, model: Path) -> None:
    """The longest sample the trainer of the run's `recorded` configuration takes, written
    before the router starts: its first episodes are cut to it too (the trainer states the
    same at its start, a few seconds later)."""
    trainer = read_file(str(recorded))["trainer"]
    mrl, tpg = int(trainer["max_response_len"]), int(trainer["max_tokens_per_gpu"])
    buffer.set_limits(limits_of(str(model), tpg, mrl).stated())


def check_sample_fit(info: dict[str, Any], recorded: Path, say: Callable[[str], None]) -> None:
    """The router's longest samples (its ready file's `longest_prompt` and
    `rollout_max_response_len`) against the trainer of the run's `recorded` configuration:
    ChildFailedError when the longer ones would not fit; for environment episodes (their
    prompts grow; the router cuts them where the trainer's limits end) a note when the model's
    context (`context_len`) is larger than the trainer takes."""
    trainer = read_file(str(recorded)).get("trainer", {})
    budget = int(trainer.get("max_tokens_per_gpu", 0)) + 1
    most = int(trainer.get("max_response_len", 0))
    longest, length = info.get("longest_prompt"), info.get("rollout_max_response_len")
    if isinstance(longest, int) and isinstance(length, int):
        if longest + length > budget or length > most:
            raise ChildFailedError(
                f"the router's samples may reach {longest + length} tokens (its longest prompt, "
                f"{longest}, and responses up to {length}: --rollout-max-response-len) and "
                f"the trainer takes at most {budget} in all (--max-tokens-per-gpu {budget - 1}: "
                f"a sample's inputs, every token but its last) and {most} of response "
                "(--max-response-len): the longer ones would be dead-lettered as too_long, never "
                "trained (a bias toward short answers). Raise the trainer's (tandem up "
                f"--trainer-args '--max-tokens-per-gpu {longest + length - 1}'), or lower "
                "--rollout-max-response-len",
                code=2,  # (a configuration refused, as the services refuse theirs)
            )
    elif isinstance(context := info.get("context_len"), int) and context > budget:
        say(
            f"environment episodes are cut at {budget} tokens, what the trainer takes "
            f"(--max-tokens-per-gpu {budget - 1}), short of the model's context, {context}: "
            "to train longer episodes, raise it (tandem up --trainer-args "
            f"'--max-tokens-per-gpu {context - 1}')"
        )
