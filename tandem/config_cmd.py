"""`tandem config`: the configuration, resolved or documented.

`tandem config show [--config FILE] [tandem up flags]` prints what `tandem up` with the same
arguments would run with, every table, as TOML (nothing starts). `tandem config reference`
prints docs/configuration.md, generated from the commands' flags (their config dataclasses):
`tandem config reference > docs/configuration.md`; a test fails when the file is stale.
"""

from __future__ import annotations

import contextlib
import sys

from services.common.config_file import ConfigError, options, toml_value
from services.common.flags import shown_default

USAGE = """usage: tandem config show [--config FILE] [tandem up flags]
       tandem config reference   (the Markdown of docs/configuration.md)"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}")
        return 0 if argv else 2
    if argv[0] == "reference":  # (with an argument it was called an unknown subcommand)
        if len(argv) > 1:
            print(f"tandem config reference takes no arguments: {argv[1:]}", file=sys.stderr)
            return 2
        print(reference(), end="")
        return 0
    if argv[0] != "show":
        print(f"tandem config: unknown subcommand {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    from tandem.launcher import parse
    from tandem.up_config import render

    with contextlib.redirect_stdout(sys.stderr):  # (a resume's notes: stdout is the TOML)
        config, problems = parse(argv[1:], prog="tandem config show")
    try:
        text = "" if problems else render(config, config.config)
    except ConfigError as exc:
        problems = [str(exc)]
    for problem in problems:
        print(f"tandem config show: {problem}", file=sys.stderr)
    if problems:
        return 2
    print(text, end="")
    return 0


INTRO = """\
# Configuration reference

Generated from the commands' flags by `tandem config reference > docs/configuration.md`
(`tests/test_config.py` fails when this file is stale): do not edit by hand.

## How settings combine

Every setting has a flag (`tandem COMMAND --help`), a key in a TOML config file and an
environment variable. For one setting, the flag wins over the variable, which wins over the file:

- **File**: `--config FILE` (every command takes it). One table per command: `[up]`,
  `[router]`, `[trainer]`, `[broker]`, `[engine]`. Keys are the flag names without the dashes,
  with underscores: `--rollout-max-response-len 1024` is `rollout_max_response_len = 1024`.
  A command reads its own table. An unknown table or key, or a value of the wrong type, stops
  the command with exit code 2, naming the file, the key and the closest valid key.
- **Environment**: `TANDEM_<TABLE>_<KEY>` in upper case, e.g.
  `TANDEM_ROUTER_ROLLOUT_MAX_RESPONSE_LEN=1024`. Lists are space-separated; booleans are
  `true`/`false` (`1`/`0`, `yes`/`no`). A variable of a command's table that names no setting
  stops the command the same way (`TANDEM_ROUTER_TOKEN`, the router's token, is no setting).
  `REDIS_URL` is also read by `tandem up` when `redis_url` is not set.
- **Flags**: as in `--help`.

With `tandem up`, the `[router]`, `[trainer]`, `[broker]` and `[engine]` tables of the file go
to the services it starts; the settings `tandem up` gives a service itself (the model, the batch
terms, addresses, ...) are set in `[up]` (a service table that contradicts them is refused).
`--router-args`, `--trainer-args` and `--engine-args` add flags last (a value starting with
`--` works in both spellings: `--trainer-args "--bf16"`, `--trainer-args=--bf16`).

`tandem config show [--config FILE] [flags]` prints the resolved configuration (nothing
starts). Every `tandem up` run folder gets it as `config.toml`, and each service reads its table
from there; `tandem up --config RUN_DIR/config.toml` repeats the run (in a new folder). Keys
written as comments there are set by `tandem up` itself.

```toml
[up]
model = "/models/Qwen3-0.6B"
prompt_data = "data/train.jsonl"
custom_rm_path = "rewards.py:score"
rollout_max_response_len = 1024
engine_gpus = [0]
trainer_gpus = [0]

[router]
apply_chat_template = true

[trainer]
bf16 = true

[engine]
kv_cache_gb = 8.0
```
"""

SECTIONS_TEXT = {
    "up": "`tandem up`: the whole loop on one machine.",
    "router": "`tandem router`: rollout router.",
    "trainer": "`tandem trainer`: megatron-core RL trainer.",
    "broker": "`tandem broker`: weight broker.",
    "engine": "`tandem engine`: reference inference engine.",
}


def reference() -> str:
    """docs/configuration.md: every table's keys with flag, default and meaning."""
    from tandem.up_config import PARSERS

    out = [INTRO]
    for name, build in PARSERS.items():
        parser = build()
        keys = options(parser)
        out.append(f"\n## [{name}]\n\n{SECTIONS_TEXT[name]}\n")
        for group in parser._action_groups:
            actions = [a for a in group._group_actions if a.dest in keys]
            if not actions:
                continue
            if group.title not in ("options", "optional arguments"):
                out.append(f"\n### {group.title}\n")
            out.append("\n| key | flag | default | meaning |\n| --- | --- | --- | --- |")
            for action in actions:
                default = "not set" if action.default is None else toml_value(action.default)
                meaning = (action.help or "").removesuffix(
                    f" (default: {shown_default(action.default)})"
                )
                if action.choices:
                    choices = (toml_value(c) if c == "" else str(c) for c in action.choices)
                    meaning += f" One of: {', '.join(choices)}."
                row = [f"`{action.dest}`", f"`{action.option_strings[0]}`", f"`{default}`"]
                out.append("| " + " | ".join([*row, meaning.replace("|", "\\|")]) + " |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"
