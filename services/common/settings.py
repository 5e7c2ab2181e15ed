"""One loader for every service's typed, nested configuration: defaults < TOML < env < flags.

A service's config is a pydantic model whose fields are sections (`Section` subclasses, or any
pydantic model such as `proto.run_terms.RunTerms`) and, at the top, a few plain fields. Each
leaf field is one setting, known everywhere by its name, which is unique in the tree:

- flag `--leaf-name` (`--lr`, `--rollout-batch-size`; a bool is `--x/--no-x`, a list takes
  words: `--engine-urls A B`), its help the field's attribute docstring plus its default;
- key `leaf_name` of the service's TOML table (`[trainer] lr = 1e-5`), given by `--config FILE`
  (a section may be a sub-table too: `[trainer.optimizer] lr = 1e-5`);
- variable `TANDEM_<SVC>_<LEAF_NAME>` (`TANDEM_TRAINER_LR=1e-5`; a list space-separated, shell
  quoting; a bool true/false, 1/0, yes/no, on/off);
- keyword of the config's constructor: `TrainerConfig(lr=1e-5)` nests it into its section
  (`config.optimizer.lr`), as `TrainerConfig(optimizer={"lr": 1e-5})` does.

Precedence: field default < the file's table < variables < flags. Ranges and choices are in the
field types (`Annotated[int, Field(ge=1)]`, `Literal[...]`); nan and inf are refused everywhere.
Arithmetic across fields is the config's own `validate()` (one per config); start-up checks that
read files or import user code are `check(config) -> list[str]` in services/<svc>/config.py.

The API (what `tandem up` builds on):
- `load(Cls, argv, table, prog=...) -> Cls`: the service's config; a bad flag, variable, key or
  value exits 2 with `prog: error: ...` naming it (`--lr 2: ...`, `environment variable
  TANDEM_TRAINER_LR=2: ...`, `FILE: [trainer] lr = 2: ...`).
- `resolve(Cls, argv, table, prog=...) -> (Cls, origins)`: the same, raising `ConfigError`
  (argparse still exits 2 for an unknown flag or choice); `origins` maps each leaf to
  "default", "file", "env" or "flag".
- `parser(Cls, prog, description)`: the argparse parser (its `--help`; `--config FILE`).
- `to_toml(config, table)`: the resolved config as a TOML table (every leaf, flat keys), which
  `load(Cls, ["--config", path], table)` reads back to an equal config.
- `leaves(Cls)`: each leaf's path of section names (`{"lr": ("optimizer", "lr"), ...}`);
  `flat(config)`: each leaf's value by its name.
- `Count`, `Positive`, `Seconds`, `PositiveSeconds`: the ranges most fields share;
  `unless(...)`: a range with a gap (-1 for all, else at least 1);
  `ServeSection`: an HTTP service's host, port, ready file, body cap and shutdown grace.

Knows pydantic, argparse and TOML; nothing of what any setting means.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import tomllib
import typing
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

TABLES = ("up", "router", "trainer", "broker", "engine")
NOT_SETTINGS = ("TANDEM_ROUTER_TOKEN",)  # variables of that form that are no setting
NOT_TEXT = ("number", "bool")  # a string in a file for one of these was quoted by mistake
Origin = Literal["default", "file", "env", "flag"]
# How a refusal of a number's range is said (pydantic's error type -> words)
SAID = {
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be more than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "finite_number": "not a finite number",
}
C = TypeVar("C", bound=BaseModel)


class ConfigError(ValueError):
    """A flag, variable, config file or value that cannot be used; the message names it."""


class Section(BaseModel):
    """Base of config sections: unknown fields refused, help from attribute docstrings, no
    nan/inf; flat keywords of its sub-sections' leaves are nested into them."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False, validate_assignment=True
    )

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data, paths = dict(data), leaves(cls)
        moved: dict[str, dict[str, Any]] = {}
        for key in [k for k in data if len(paths.get(k, (k,))) > 1]:
            if key in cls.model_fields and isinstance(data[key], dict | BaseModel):
                continue  # the section of that name (`model` a section, `run.model` a leaf)
            moved.setdefault(paths[key][0], {})[key] = data.pop(key)
        for section, values in moved.items():  # (onto its default: a service's own port)
            inner = data.get(section) or cls.model_fields[section].get_default(
                call_default_factory=True
            )
            inner = inner.model_dump() if isinstance(inner, BaseModel) else dict(inner)
            data[section] = {**inner, **values}
        return data


def _section(kind: Any) -> type[BaseModel] | None:
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


@cache
def _fields(cls: type[BaseModel]) -> dict[str, tuple[tuple[str, ...], Any]]:
    """Each leaf setting: its path of field names and its field; a name used twice is an error."""
    out: dict[str, tuple[tuple[str, ...], Any]] = {}
    for name, info in cls.model_fields.items():
        sub = _section(info.annotation)
        found = {k: ((name, *p), i) for k, (p, i) in _fields(sub).items()} if sub else {}
        if twice := out.keys() & (found.keys() or {name}):
            raise TypeError(f"{cls.__name__}: setting {sorted(twice)} named twice in the tree")
        out |= found or {name: ((name,), info)}
    return out


@cache
def leaves(cls: type[BaseModel]) -> dict[str, tuple[str, ...]]:
    """Each leaf setting's path of field names (`{"lr": ("optimizer", "lr"), ...}`)."""
    return {leaf: path for leaf, (path, _) in _fields(cls).items()}


def _get(config: BaseModel, path: tuple[str, ...]) -> Any:
    value: Any = config
    for name in path:
        value = getattr(value, name)
    return value


def flat(config: BaseModel) -> dict[str, Any]:
    """Every leaf's value by its name."""
    return {leaf: _get(config, path) for leaf, path in leaves(type(config)).items()}


def _kind(annotation: Any) -> tuple[str, tuple[Any, ...] | None]:
    """("bool" | "list" | "str" | "number", choices) of a leaf's annotation."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if annotation is bool:
        return "bool", None
    if typing.get_origin(annotation) is list:
        return "list", None
    if typing.get_origin(annotation) is Literal:
        return "str", typing.get_args(annotation)
    return ("str" if annotation is str else "number"), None


def _help(info: Any, default: Any) -> str:
    text = " ".join((info.description or "").split())
    if isinstance(default, list):
        default = " ".join(map(str, default)) or "none"
    if default == "" or "(default:" in text or "(empty =" in text or isinstance(default, bool):
        return text
    return f"{text} (default: {default})"


def parser(cls: type[BaseModel], prog: str, description: str = "") -> argparse.ArgumentParser:
    """The command's parser: one flag per leaf (grouped by section), and `--config FILE`. Its
    defaults are unset markers: `resolve` tells a flag given from one left out."""
    table = prog.split()[-1]
    out = argparse.ArgumentParser(prog=prog, description=description)
    out.add_argument(
        "--config",
        default="",
        help=f"TOML file whose [{table}] table sets these settings (keys: flag names with "
        f"underscores); TANDEM_{table.upper()}_<KEY> variables override it, flags override "
        "both (docs/configuration.md).",
    )
    groups: dict[str, Any] = {}
    made = cls()
    for leaf, path in leaves(cls).items():
        title = path[0] if len(path) > 1 else "general"
        group = groups.get(title) or groups.setdefault(title, out.add_argument_group(title))
        info, default = _fields(cls)[leaf][1], _get(made, path)
        kind, choices = _kind(info.annotation)
        flag = "--" + leaf.replace("_", "-")
        common = {"default": argparse.SUPPRESS, "help": _help(info, default), "dest": leaf}
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif kind == "list":
            group.add_argument(flag, nargs="*", **common)
        else:
            group.add_argument(flag, choices=choices, metavar=_metavar(leaf, choices), **common)
    return out


def _metavar(leaf: str, choices: tuple[Any, ...] | None) -> str:
    return "{" + ",".join(map(str, choices)) + "}" if choices else leaf.upper()


def read_table(path: str, table: str) -> dict[str, Any]:
    """The file's [table] (empty when it has none); ConfigError for a file that cannot be read,
    is no TOML, or has an unknown table or a key outside any."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"--config {path}: no such file") from exc
    except OSError as exc:  # (a folder, a file it may not read)
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not a text file (not UTF-8: {exc.reason})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from exc
    for name, value in data.items():
        if not isinstance(value, dict):
            raise ConfigError(
                f"{path}: {name} = {toml_value(value)} is outside any table: put it under "
                f"the table of its command ({', '.join(f'[{t}]' for t in TABLES)})"
            )
        if name not in TABLES:
            raise ConfigError(f"{path}: unknown table [{name}]{suggestion(name, TABLES)}")
    return dict(data.get(table, {}))


def suggestion(key: str, valid: Any) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), list(valid), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _file_values(cls: type[BaseModel], path: str, table: str, prog: str) -> dict[str, Any]:
    """The table's leaves (sub-tables of sections flattened), each checked to be a setting and
    not a quoted number or bool."""
    paths, values = leaves(cls), {}
    pending = list(read_table(path, table).items()) if path else []
    while pending:
        key, value = pending.pop(0)
        if isinstance(value, dict):  # a section's sub-table (no setting takes a table)
            pending += list(value.items())
            continue
        if key not in paths:
            raise ConfigError(
                f"{path}: [{table}] unknown key {key!r}{suggestion(key, paths)} "
                f"(`{prog} --help` lists the flags; keys use underscores)"
            )
        if isinstance(value, str) and _kind(_fields(cls)[key][1].annotation)[0] in NOT_TEXT:
            raise ConfigError(
                f"{path}: [{table}] {key} = {toml_value(value)}: a string: write it without quotes"
            )
        values[key] = value
    return values


def _env_values(cls: type[BaseModel], prefix: str, prog: str) -> dict[str, Any]:
    paths, values = leaves(cls), {}
    for name in sorted(n for n in os.environ if n.startswith(prefix) and n not in NOT_SETTINGS):
        key = name.removeprefix(prefix).lower()
        if key not in paths:
            raise ConfigError(
                f"environment variable {name}: {prog} has no setting {key!r}"
                f"{suggestion(key, paths)} (`{prog} --help` lists them)"
            )
        value: Any = os.environ[name]
        if _kind(_fields(cls)[key][1].annotation)[0] == "list":
            try:
                value = shlex.split(value)
            except ValueError as exc:  # (an unclosed quote)
                raise ConfigError(f"environment variable {name}={value}: {exc}") from exc
        values[key] = value
    return values


def resolve(
    cls: type[C], argv: list[str], table: str, prog: str = "", env_prefix: str = "", about: str = ""
) -> tuple[C, dict[str, Origin]]:
    """The config of `argv` over the environment over `--config FILE`'s [table] over the
    defaults, and where each leaf's value came from; ConfigError naming what to fix (argparse
    itself exits 2 for an unknown flag or a bad choice)."""
    prog = prog or f"tandem {table}"
    prefix = env_prefix or f"TANDEM_{table.upper()}_"
    args = vars(parser(cls, prog, about).parse_args(argv))
    path = str(args.pop("config", ""))
    layers: list[tuple[Origin, dict[str, Any]]] = [
        ("file", _file_values(cls, path, table, prog)),
        ("env", _env_values(cls, prefix, prog)),
        ("flag", args),
    ]
    values: dict[str, Any] = {}
    origins: dict[str, Origin] = dict.fromkeys(leaves(cls), "default")
    for origin, layer in layers:
        values |= layer
        origins |= dict.fromkeys(layer, origin)
    try:
        return cls(**values), origins
    except ValidationError as exc:  # (the first error, named as the user gave the value)
        error = exc.errors()[0]
        leaf = next((str(p) for p in reversed(error["loc"]) if str(p) in origins), "")
        value = values.get(leaf, error.get("input"))
        shown = " ".join(map(str, value)) if isinstance(value, list) else value
        where = {
            "flag": f"--{leaf.replace('_', '-')} {shown}",
            "env": f"environment variable {prefix}{leaf.upper()}={shown}",
            "file": f"{path}: [{table}] {leaf} = {toml_value(value)}",
        }.get(origins.get(leaf, "default"), f"--{leaf.replace('_', '-')} {shown}")
        raise ConfigError(f"{where}: {refusal(exc)}") from None


def refusal(exc: ValidationError) -> str:
    """How the first error of a refused value is said ("must be at least 1")."""
    error = exc.errors()[0]
    ctx = {k: f"{v:g}" if isinstance(v, float) else v for k, v in error.get("ctx", {}).items()}
    return SAID.get(error["type"], error["msg"]).format(**ctx)


def load(
    cls: type[C], argv: list[str], table: str, prog: str = "", env_prefix: str = "", about: str = ""
) -> C:
    """`resolve`'s config; a ConfigError exits 2 with `prog: error: <message>`. `about`: the
    command's description in `--help`."""
    prog = prog or f"tandem {table}"
    try:
        return resolve(cls, argv, table, prog, env_prefix, about)[0]
    except ConfigError as exc:
        parser(cls, prog).exit(2, f"{prog}: error: {exc}\n")


def to_toml(config: BaseModel, table: str, notes: dict[str, str] | None = None) -> str:
    """`config` as TOML text: `[table]` and every leaf as `key = value`; a key with a note is
    written as a comment (`# key = value  # note`): shown, not set."""
    lines = [f"[{table}]"]
    for key, value in flat(config).items():
        if value is None:
            lines.append(f"# {key} is not set")
        elif key in (notes or {}):
            lines.append(f"# {key} = {toml_value(value)}  # {(notes or {})[key]}")
        else:
            lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


# Ranges most settings share (a field with another one states it in its own type).
Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(ge=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]


def unless(special: float, meaning: str, lowest: float, above: bool = False) -> AfterValidator:
    """A field's rule where its range has a gap: at least `lowest` (`above`: more than it), or
    `special`, a value that means `meaning` (`Annotated[int, Field(ge=-1), unless(-1, "all",
    1)]`: -1 for all, else at least 1; its `Field` bounds state the rest)."""
    said = f"must be {'more than' if above else 'at least'} {lowest:g}, or {special:g} ({meaning})"

    def check(value: float) -> float:
        if value != special and (value < lowest or (above and value == lowest)):
            raise PydanticCustomError("unless", said)
        return value

    return AfterValidator(check)


class ServeSection(Section):
    """Where an HTTP service listens and how it answers (its defaults set by each service)."""

    host: str = "127.0.0.1"
    """Bind address."""
    port: Annotated[int, Field(ge=0, le=65535)] = 30000
    """Port (0 = any free port)."""
    ready_file: str = ""
    """Write {url, host, port, pid, ...} here as JSON once serving."""
    max_request_bytes: Count = 16 << 20
    """Largest request body accepted; larger ones get 413 before they are read (0 = no cap)."""
    graceful_shutdown_s: Seconds = 10.0
    """On SIGTERM, how long running requests may finish before they are cancelled."""
