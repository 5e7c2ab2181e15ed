"""Config files and environment variables under a command's flags: file < environment < flags.

A TOML file given with `--config FILE` has one table per command: `[up]`, `[router]`,
`[trainer]`, `[broker]`, `[engine]`. Keys are the flag names without the leading dashes, with
underscores (`--rollout-max-response-len` -> `rollout_max_response_len = 1024`); a command reads
its own table and ignores the others. An environment variable `TANDEM_<TABLE>_<KEY>` in upper
case (`TANDEM_ROUTER_ROLLOUT_MAX_RESPONSE_LEN=1024`) overrides the file; a flag overrides both.
Values: TOML types in the file (lists as arrays); in a variable, lists are space-separated and
booleans are true/false (also 1/0, yes/no). An unknown table or key, or a value of the wrong
type, is an error (exit 2) naming the key, the file and the closest valid key; so is a number
out of range, named as it was given (the flag, the variable or the file's key).

Knows: argparse parsers and TOML. Of what a flag means, only what its name and default say of
its number (`number_rules`: a time in seconds, a count, a learning rate).
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import shlex
import tomllib
from pathlib import Path
from typing import Any

SECTIONS = ("up", "router", "trainer", "broker", "engine")
ENV_PREFIX = "TANDEM_"
NOT_KEYS = ("help", "config")  # parser destinations that are no setting
NOT_SETTINGS = ("TANDEM_ROUTER_TOKEN",)  # variables of that form that are no setting
# The highest learning rate taken (RL post-training takes ~1e-6 to 1e-4; 1e9 was trained on).
MAX_LR = 1.0


class ConfigError(ValueError):
    """A config file or variable that cannot be used; the message names it."""


def add_config_flag(parser: argparse.ArgumentParser, section: str) -> None:
    parser.add_argument(
        "--config",
        default="",
        help=f"TOML file whose [{section}] table sets defaults for these flags (keys: flag "
        f"names with underscores); TANDEM_{section.upper()}_<KEY> variables override it, flags "
        "override both (docs/configuration.md).",
    )


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's settings by key (destination), without --help and --config."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_KEYS}


def read_file(path: str) -> dict[str, dict[str, Any]]:
    """The file's tables; an unknown table, or a file that is no TOML, is a ConfigError."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"--config {path}: no such file") from exc
    except OSError as exc:  # (a folder, a file it may not read: a traceback, exit 1)
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not a text file (not UTF-8: {exc.reason})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from exc
    for name, table in data.items():
        if not isinstance(table, dict):  # (a key above every table: it was an unknown table)
            raise ConfigError(
                f"{path}: {name} = {toml_value(table)} is outside any table: put it under "
                f"the table of its command ({', '.join(f'[{s}]' for s in SECTIONS)})"
            )
        if name not in SECTIONS:
            raise ConfigError(f"{path}: unknown table [{name}]{suggestion(name, SECTIONS)}")
    return data


def suggestion(key: str, valid: Any) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), list(valid), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def table_values(
    parser: argparse.ArgumentParser, section: str, path: str, table: dict[str, Any]
) -> dict[str, Any]:
    """`table` checked and converted to the parser's types."""
    actions = options(parser)
    values = {}
    for key, value in table.items():
        if key not in actions:
            raise ConfigError(
                f"{path}: [{section}] unknown key {key!r}{suggestion(key, actions)} "
                f"(`{parser.prog} --help` lists the flags; keys use underscores)"
            )
        values[key] = convert(actions[key], value, f"{path}: [{section}] {key}", text=False)
    return values


def env_values(parser: argparse.ArgumentParser, section: str) -> dict[str, Any]:
    """Values of the `TANDEM_<SECTION>_<KEY>` variables that are set; ConfigError for one of
    no setting (TANDEM_UP_MAX_STEP=5 was ignored without a word), as for a file's key."""
    values, actions, prefix = {}, options(parser), f"{ENV_PREFIX}{section.upper()}_"
    for name in sorted(n for n in os.environ if n.startswith(prefix) and n not in NOT_SETTINGS):
        key = name.removeprefix(prefix).lower()
        if key not in actions:
            raise ConfigError(
                f"environment variable {name}: {parser.prog} has no setting {key!r}"
                f"{suggestion(key, actions)} (`{parser.prog} --help` lists them)"
            )
        values[key] = convert(actions[key], os.environ[name], f"environment variable {name}")
    return values


def layered_defaults(parser: argparse.ArgumentParser, section: str, path: str) -> dict[str, Any]:
    """The file's [section] values overridden by the environment's (flags come on top)."""
    table = read_file(path).get(section, {}) if path else {}
    return {**table_values(parser, section, path, table), **env_values(parser, section)}


def config_path(argv: list[str]) -> str:
    """The `--config` value in `argv` ("" when none)."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--config", default="")
    return str(probe.parse_known_args(argv)[0].config)


def parse_args(
    parser: argparse.ArgumentParser, argv: list[str], section: str
) -> argparse.Namespace:
    """`parser.parse_args(argv)` over the `--config` file's [section] and the environment;
    a bad file or variable exits 2 with the message (as argparse does for a bad flag), and so
    does a number `number_problem` refuses."""
    if "config" not in {a.dest for a in parser._actions}:
        add_config_flag(parser, section)
    rules, path = number_rules(parser), config_path(argv)
    try:
        parser.set_defaults(**layered_defaults(parser, section, path))
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    args = parser.parse_args(argv)
    if problem := number_problem(parser, args, rules, sources(parser, argv, section, path)):
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    return args


Rules = dict[str, tuple[str, float, float]]


def number_rules(parser: argparse.ArgumentParser) -> Rules:
    """Per flag of `parser` (at its own defaults: take them before a file's), what its value
    must be, the default that is allowed below 0, and the highest value: at least 0 for an
    integer whose default is not negative (a count, a length, a port) or a time in seconds (a
    flag ending in -s whose default is not negative); 0 or more, or the default, where that is
    below 0 (-1: "the model's", "all"); a learning rate (--lr, --*-lr) 0 to MAX_LR."""
    rules = {
        a.dest: (
            "a time in seconds, at least 0" if a.dest.endswith("_s") else "at least 0",
            0.0,
            math.inf,
        )
        for a in parser._actions
        if _number(a.default) >= 0 and (a.dest.endswith("_s") or isinstance(a.default, int))
    }
    rules |= {  # (--ckpt-step -3 was taken for the latest, --metrics-port -3 for none)
        a.dest: (f"at least 0, or {a.default:g} (its default: see --help)", a.default, math.inf)
        for a in parser._actions
        if _number(a.default) < 0
    }
    rate = f"a learning rate, at least 0 and at most {MAX_LR:g} (RL post-training: ~1e-6 to 1e-4)"
    return rules | {
        a.dest: (rate, 0.0, MAX_LR)
        for a in parser._actions
        if a.dest == "lr" or a.dest.endswith("_lr")
    }


def sources(
    parser: argparse.ArgumentParser, argv: list[str], section: str, path: str
) -> dict[str, str]:
    """How a refusal names the value of each setting that `argv` does not give (what comes
    before the value): its `TANDEM_<SECTION>_<KEY>` variable, else its key in the --config
    file `path`. A flag given is named as the flag (TANDEM_UP_LR=nan was named `--lr nan`, a
    flag nobody typed)."""
    unset = object()  # (argparse leaves what a namespace holds already, unless a flag sets it)
    given = argparse.Namespace(**dict.fromkeys(options(parser), unset))
    parser.parse_known_args(argv, given)
    table = read_file(path).get(section, {}) if path else {}
    named = {}
    for key in (key for key in options(parser) if getattr(given, key) is unset):
        variable = f"{ENV_PREFIX}{section.upper()}_{key.upper()}"
        if variable in os.environ:
            named[key] = f"environment variable {variable}="
        elif key in table:
            named[key] = f"{path}: [{section}] {key} = "
    return named


def number_problem(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    rules: Rules,
    named: dict[str, str] | None = None,
) -> str:
    """The first number of `args` that is refused ("" when none is), named by its flag, or as
    `named` (`sources`) says: nan or inf (float() takes them: a timeout of nan crashed a
    service later with "cannot convert float NaN to integer", a bound of nan bounded nothing,
    a learning rate of inf was taken), or a value that `rules` refuses (a timeout of -3 s was
    taken, a learning rate of 1e9)."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        said = (named or {}).get(action.dest) or f"{(action.option_strings or [''])[0]} "
        for v in _listed(value):
            if isinstance(v, float) and not math.isfinite(v):
                what = "not a number" if math.isnan(v) else "not a finite number"
                return f"{said}{v}: {what}"
        rule, default, highest = rules.get(action.dest, ("", 0, math.inf))
        if rule and ((_number(value) < 0 and value != default) or _number(value) > highest):
            return f"{said}{value:g}: {rule}"
    return ""


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _number(value: Any) -> float:
    """`value` when it is a number (not a bool), else nan (no comparison holds)."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def convert(action: argparse.Action, value: Any, where: str, text: bool = True) -> Any:
    """`value` as the flag's type; checks choices. `text`: a variable's string, read as a
    flag's; else a TOML value, whose type must be the flag's (a number, a boolean or a list
    written as a string in the file is refused: quoted by mistake)."""
    quoted = "" if text else " (a string: write it without quotes)"
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        if text and isinstance(value, str) and value.lower() in TRUE + FALSE:
            return value.lower() in TRUE
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}{quoted}")
        return value
    if action.nargs in ("*", "+"):
        try:
            items = shlex.split(value) if text and isinstance(value, str) else value
        except ValueError as exc:  # (an unclosed quote)
            raise ConfigError(f"{where}: {value!r}: {exc} (quote it as in a shell)") from exc
        if not isinstance(items, list):
            raise ConfigError(f"{where}: expected a list ([...]), got {value!r}")
        return [_scalar(action, item, where, text) for item in items]
    return _scalar(action, value, where, text)


def _scalar(action: argparse.Action, value: Any, where: str, text: bool) -> Any:
    kind: Any = action.type if callable(action.type) else str
    if not text and isinstance(value, str) and kind in (int, float):
        raise ConfigError(
            f"{where}: expected {_a(kind)}, got {value!r} (a string: write it without quotes)"
        )
    if isinstance(value, str) and kind is not str:
        try:
            value = kind(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {value!r} is not {_a(kind)}") from exc
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(kind, True)
    if not ok:
        raise ConfigError(f"{where}: expected {_a(kind)}, got {value!r}")
    value = kind(value)
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: {value!r} is not one of {choices}")
    return value


def _a(kind: Any) -> str:
    name = getattr(kind, "__name__", str(kind))
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def to_toml(tables: dict[str, dict[str, Any]], notes: dict[str, dict[str, str]]) -> str:
    """Tables as TOML text; a key with a note in `notes[table]` is written as a comment
    (`# key = value  # note`): what a command was given another way, shown, not set."""
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        for key, value in table.items():
            note = notes.get(name, {}).get(key)
            if value is None:
                lines.append(f"# {key} is not set")
            elif note is None:
                lines.append(f"{key} = {toml_value(value)}")
            else:
                lines.append(f"# {key} = {toml_value(value)}  # {note}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # inf and nan are TOML too
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'
