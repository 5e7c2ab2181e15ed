"""Build argparse flags from a service's `Config` dataclass, and the config back from them.

Each field becomes `--field-name`; its `metadata["help"]` is the flag's help, its default the
flag's default. Nested dataclass fields (a sub-config) contribute their own fields, flat, so a
service's whole configuration is visible in one `--help`. Booleans get `--x/--no-x`.
`config_file.parse_args` puts a TOML file's table and `TANDEM_<TABLE>_<KEY>` variables under
these flags (each field's key is its name).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_args(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add one flag per field of dataclass `cls` (recursing into sub-configs)."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            add_config_args(parser, kind, f"{kind.__name__} ({f.name})")  # type: ignore[arg-type,union-attr]
            continue
        default = (
            f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
        )
        help_text = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        origin = typing.get_origin(kind)
        args = typing.get_args(kind)
        if kind is bool:
            group.add_argument(
                _flag(f.name),
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
        elif origin is list:
            group.add_argument(
                _flag(f.name),
                nargs="*",
                type=args[0],
                default=default,
                help=_with_default(help_text, shown_default(default)),
            )
        else:
            base = next((a for a in args if a is not type(None)), str) if args else kind
            group.add_argument(
                _flag(f.name),
                type=base,
                default=default,
                choices=choices,
                help=_with_default(help_text, shown_default(default)),
            )


def shown_default(default: object) -> object:
    """A default as `--help` shows it (a list as its flag's words)."""
    if isinstance(default, list):
        return " ".join(map(str, default)) or "none"
    return default


def _with_default(help_text: str, default: object) -> str:
    """`help_text` ending with its default, unless it states it already or the default is
    empty (a help text then says what empty means)."""
    if default == "" or "(default:" in help_text or "(empty =" in help_text:
        return help_text
    return f"{help_text} (default: {default})"


def config_from_args(cls: type[T], ns: argparse.Namespace) -> T:
    """Instantiate dataclass `cls` from parsed flags added by `add_config_args`; a pydantic
    config (`services.common.settings`) from the flags of its leaves."""
    if hasattr(cls, "model_fields"):
        from services.common.settings import leaves

        return cls(**{k: v for k, v in vars(ns).items() if k in leaves(cls)})  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            kwargs[f.name] = config_from_args(kind, ns)  # type: ignore[type-var,arg-type]
        else:
            kwargs[f.name] = getattr(ns, f.name)
    return cls(**kwargs)
