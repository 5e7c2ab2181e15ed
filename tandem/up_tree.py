"""`tandem up`'s configuration tree: its launch section (`UpConfig`, with the run terms, once)
and each service's own config class, composed, never copied.

A service setting under `tandem up` is a flag of its section: bare where one service alone has
it (`--rollout-temperature 0.7`, `--lr 1e-5`), or with the service's name, which always works
(`--router.rollout-temperature 0.7`; needed where services share a name: `--trainer.num-threads
4`); a key of the service's table of `--config FILE` (`[router] rollout_temperature = 0.7`); or
its `TANDEM_<SVC>_<KEY>` variable, as the service itself reads them (services/common/settings.py).
The run terms (`RunTerms`: the model, the seed, the batch terms, ...) are [up]'s and are filled
into each service's `run` section: a service table, variable or named flag that gives one
another value is refused, naming both. What `tandem up` sets per run (the run id, addresses,
ports, ready files, where the trainer saves) is refused in a service's table, naming it.

Knows the services' config classes and the settings loader; nothing of starting them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pydantic import PositiveInt, TypeAdapter, ValidationError

from services.common.settings import (
    ConfigError,
    Origin,
    flat,
    leaves,
    refusal,
    resolve,
    suggestion,
    to_toml,
)
from services.engine.config import EngineConfig
from services.rollout_router.config import RouterConfig
from services.trainer.config import TrainerConfig
from services.weight_broker.config import BrokerConfig
from tandem.up_launch import MODEL_DEFAULTS, UpConfig

SERVICES: dict[str, Any] = {
    "router": RouterConfig,
    "trainer": TrainerConfig,
    "broker": BrokerConfig,
    "engine": EngineConfig,
}
RUN_TERMS = set(leaves(UpConfig)) - set(UpConfig.model_fields)
# tandem up's flags that name a service's setting by the name tandem up has always used.
ALIASES = {
    "engine_device": ("engine", "device"),
    "keep_checkpoints": ("trainer", "keep_last_checkpoints"),
}
# A run term a service names otherwise: the broker's --transport is [up]'s weight_transport.
TERM_NAMES = {"broker": {"transport": "weight_transport"}}
# What tandem up gives a service per run (addresses, files, the run's Redis): not a table's.
PER_RUN = {
    "run_id",
    "redis_url",
    "host",
    "port",
    "ready_file",
    "engine_urls",
    "broker_url",
    "weights_endpoint",
    "weights_shm_dir",
    "metrics_port",
    "save_hf",
}
# tandem up's defaults for a service's settings it was not given (the services' own are for a
# cluster's launcher: a trainer that runs until stopped, saves nothing).
UP_DEFAULTS: dict[str, dict[str, Any]] = {
    "trainer": {"max_steps": 300, "save_interval": 10, "keep_last_checkpoints": 2}
}
# tandem up's narrower ranges of a service's settings, and why (the trainer's 0: until stopped).
UP_RANGES = {"trainer": {"max_steps": (TypeAdapter(PositiveInt), "tandem up's run ends there")}}
# Trainer settings that pick where one launch starts from: a resume that read them again would
# start there again (--ckpt-step N: back to iteration N each time).
ONE_TIME = {"ckpt_step", "new_lineage"}
RENDERED = "# Resolved by tandem up"  # the first line of a configuration `render` wrote


@dataclasses.dataclass
class UpTree:
    """`tandem up`'s whole configuration: its launch section and each service's config, the run
    terms filled in; `origins[section][key]` says where each value came from."""

    up: UpConfig
    services: dict[str, Any]
    origins: dict[str, dict[str, Origin]]
    config: str = ""  # the --config file

    @property
    def router(self) -> Any:
        return self.services["router"]

    @property
    def trainer(self) -> Any:
        return self.services["trainer"]

    def value(self, section: str, key: str) -> Any:
        """A setting of a section by its key (`tree.value("trainer", "lr")`)."""
        return flat(self.up if section == "up" else self.services[section])[key]

    def settings(self) -> dict[str, Any]:
        """Every setting by key, a service's as SERVICE/KEY (a W&B run's config)."""
        every = {f"{n}/{k}": v for n, c in self.services.items() for k, v in flat(c).items()}
        return flat(self.up) | every

    def given(self, section: str, key: str) -> bool:
        """Whether the setting was given (flag, variable or file), not left to its default."""
        return self.origins[section].get(key, "default") != "default"


def owner(flag: str) -> tuple[str, str]:
    """The section and key (`no_` kept) of a `tandem up` flag's name (without its dashes): [up]'s
    and the run terms' first, then `SERVICE.key`, an alias, or the one service that has the key.
    ConfigError for a name no section has, or one several services share."""
    key = flag.replace("-", "_")
    section, dot, rest = key.partition(".")
    if dot:
        if section not in SERVICES:
            raise ConfigError(f"--{flag}: no service {section!r}{suggestion(section, SERVICES)}")
        if _setting(rest) not in leaves(SERVICES[section]):
            raise ConfigError(f"--{flag}: the {section} has no setting {rest!r}{_close(rest)}")
        return section, rest
    if _setting(key) in leaves(UpConfig):
        return "up", key
    if key in ALIASES:
        return ALIASES[key]
    if key in ("router_args", "trainer_args", "engine_args"):
        raise ConfigError(
            f"--{flag} is gone: give the {key[:-5]}'s flags to tandem up itself (bare, or as "
            f"--{key[:-5]}.NAME: --rollout-temperature 0.7, --trainer.num-threads 2)"
        )
    has = [name for name, cls in SERVICES.items() if _setting(key) in leaves(cls)]
    if len(has) > 1:
        named = " or ".join(f"--{n}.{flag}" for n in has)
        raise ConfigError(f"--{flag} is a setting of the {' and the '.join(has)}: give {named}")
    if not has:
        raise ConfigError(f"unrecognized argument --{flag}{_close(key)} (--help lists them)")
    return has[0], key


def _setting(key: str) -> str:
    """`key` without the `no_` of a switched-off boolean (`--no-bf16`)."""
    return key[3:] if key.startswith("no_") and key not in _all_keys() else key


def _all_keys() -> set[str]:
    return {k for cls in (UpConfig, *SERVICES.values()) for k in leaves(cls)}


def _close(key: str) -> str:
    return suggestion(key, _all_keys() | set(ALIASES))


def split(argv: list[str]) -> dict[str, list[str]]:
    """`tandem up`'s command line as each section's own (`--config FILE` given to each)."""
    out: dict[str, list[str]] = {name: [] for name in ("up", *SERVICES)}
    into: list[str] = []  # the sections the words after a flag go to
    for word in argv:
        if not word.startswith("--") or word == "--":
            if not into:
                raise ConfigError(f"unrecognized argument {word!r} (--help lists the flags)")
            for name in into:
                out[name].append(word)
            continue
        flag, equals, value = word[2:].partition("=")
        if flag == "config":
            into, key = list(out), "config"
        else:
            section, key = owner(flag)
            into = [section]
        for name in into:
            out[name].append("--" + key.replace("_", "-") + (equals + value))
    return out


def compose(argv: list[str], prog: str = "tandem up") -> UpTree:
    """The tree of `tandem up ARGV`: each section resolved by the settings loader (flags over
    variables over --config's table over defaults), [up]'s run terms filled into each service
    and tandem up's defaults into what was not given; ConfigError naming what to fix."""
    parts = split(argv)
    up, up_origins = resolve(UpConfig, parts["up"], "up", prog)
    services, origins = {}, {"up": up_origins}
    for name, cls in SERVICES.items():
        try:
            services[name], origins[name] = resolve(cls, parts[name], name, prog)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    words = parts["up"]
    config = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "--config"), "")
    config = next((w.split("=", 1)[1] for w in words if w.startswith("--config=")), config)
    tree = UpTree(up.settled(), services, origins, config)
    for name in SERVICES:
        tree.services[name] = type(services[name])(**filled(tree, name))
    return tree


def filled(tree: UpTree, name: str) -> dict[str, Any]:
    """Service `name`'s settings with [up]'s run terms and tandem up's defaults filled in;
    ConfigError for a run term given to it otherwise, or a setting tandem up sets per run."""
    run, values, origins = flat(tree.up.run), flat(tree.services[name]), tree.origins[name]
    named = terms(name, values)
    for key in sorted(values.keys() & (named.keys() | PER_RUN)):
        term = named.get(key, key)
        if origins[key] == "default" or (key not in PER_RUN and values[key] == run[term]):
            continue
        if key in PER_RUN:
            raise ConfigError(
                f"{said(tree, name, key, values[key])}: tandem up sets the {name}'s "
                f"{key} per run: remove it there"
            )
        raise ConfigError(
            f"{said(tree, name, key, values[key])}, but {said(tree, 'up', term, run[term])}: a "
            f"run term is set once, in [up] (--{term.replace('_', '-')}): remove one"
        )
    values |= {key: run[term] for key, term in named.items() if key not in PER_RUN}
    defaults = dict(UP_DEFAULTS.get(name, {}))
    if name == "trainer":
        defaults["lr"] = MODEL_DEFAULTS["lr"][1 if tree.up.run.model else 0]
    if name == "engine":
        defaults["device"] = "cuda" if tree.up.engine_gpus else "cpu"
    values |= {key: value for key, value in defaults.items() if origins[key] == "default"}
    for key, (kind, why) in UP_RANGES.get(name, {}).items():
        try:
            kind.validate_python(value := values[key])
        except ValidationError as exc:
            raise ConfigError(f"{said(tree, name, key, value)}: {refusal(exc)} ({why})") from None
    return values


def terms(name: str, values: dict[str, Any]) -> dict[str, str]:
    """Service `name`'s settings that are run terms: its key -> the term's in [up]."""
    own = {k: t for k, t in TERM_NAMES.get(name, {}).items() if k in values}
    return {key: key for key in values.keys() & RUN_TERMS} | own


def said(tree: UpTree, section: str, key: str, value: Any) -> str:
    """How a value of a section was given (its flag, variable or file key), for a refusal."""
    origin = tree.origins[section].get(key, "default")
    named = "--" + (key if section == "up" else f"{section}.{key}").replace("_", "-")
    shown = " ".join(map(str, value)) if isinstance(value, list) else value
    return {
        "flag": f"{named} {shown}",
        "env": f"TANDEM_{section.upper()}_{key.upper()}={shown}",
        "file": f"[{section}] {key} = {value!r} ({tree.config})",
    }.get(origin, f"[{section}] {key} = {value!r} (tandem up's default)")


def wired(tree: UpTree, run: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """Each service's config as a run's child gets it (its file, RUN_DIR/<service>.toml): the
    per-run values of `run` (by key: the run id, Redis, the model used, ...) set where the
    service has them, and a note per setting tandem up gave it (for config.toml)."""
    configs, notes = {}, {}
    for name, config in tree.services.items():
        values = flat(config)
        given = {k for k in values if tree.given(name, k)}
        per_run = {k: v for k, v in run.items() if k in values and k not in given}
        notes[name] = {k: f"set by tandem up from [up] {t}" for k, t in terms(name, values).items()}
        per_key = (per_run.keys() | values.keys() & PER_RUN) - given - (RUN_TERMS - PER_RUN)
        notes[name] |= {k: "set by tandem up per run" for k in per_key}
        notes[name] |= {
            k: "one launch's choice, not recorded: give it again" for k in ONE_TIME & values.keys()
        }
        configs[name] = type(config)(**(values | per_run))
    return configs, notes


def render(tree: UpTree, run: dict[str, Any]) -> str:
    """The whole configuration as config.toml: [up], then each service's table as its child
    gets it, what tandem up sets written as comments (`tandem up --config THIS_FILE` repeats
    the run without contradicting itself); secrets are not recorded."""
    configs, notes = wired(tree, run)
    up = tree.up.model_copy(update={"resume": "", "run_dir": ""})  # a repeat is a new run
    text = to_toml(up, "up", {"run_id": "set by tandem up per run"})
    for name, config in configs.items():
        secrets = {
            k: "not recorded (a secret): give it again"
            for k, v in flat(config).items()
            if k.endswith("token") and v
        }
        if secrets:
            config = type(config)(**(flat(config) | dict.fromkeys(secrets, "")))
        text += "\n" + to_toml(config, name, notes[name] | secrets)
    header = (
        f"{RENDERED}: the configuration of this run, every service.\n"
        "# Repeat it: tandem up --config THIS_FILE (flags given beside it override it).\n"
        "# Commented keys are set by tandem up itself; change them in [up].\n\n"
    )
    return header + text


def child_file(configs: dict[str, Any], name: str, run_dir: Path) -> Path:
    """Service `name`'s resolved section as RUN_DIR/<name>.toml, which its child reads
    (`--config`)."""
    path = run_dir / f"{name}.toml"
    path.write_text(to_toml(configs[name], name))
    return path
