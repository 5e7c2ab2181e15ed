"""`tandem config`: the configuration, resolved or documented.

`tandem config show [--origin] [--config FILE] [tandem up flags]` prints what `tandem up` with
the same arguments would run with, every table, as TOML (nothing starts): a value that stands
for another (`-1`: the model's default) is shown as the one the run uses, the given one in a
comment; `--origin` says in a comment where each value comes from (default, tandem up's
default, the file's table and key, an environment variable, a flag). `tandem config reference`
prints docs/configuration.md, generated from the commands' flags (their config dataclasses):
`tandem config reference > docs/configuration.md`; a test fails when the file is stale.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.settings import flat, parser, toml_value

if TYPE_CHECKING:
    from tandem.up_tree import UpTree

USAGE = """usage: tandem config show [--origin] [--config FILE] [tandem up flags]
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
    from tandem.up_services import run_values
    from tandem.up_tree import render

    origin = "--origin" in argv[1:]
    with contextlib.redirect_stdout(sys.stderr):  # (a resume's notes: stdout is the TOML)
        tree, problems = parse([a for a in argv[1:] if a != "--origin"], "tandem config show")
    if tree is not None and not problems:
        model = Path(tree.up.run.model or "RUN_DIR/model")
        redis = tree.up.run.redis_url or "redis://STARTED-BY-TANDEM-UP"
        text = render(tree, run_values(tree, "up-RUN", model, redis, Path("RUN_DIR")))
        text = annotated(text, tree, origin)
    for problem in problems:
        print(f"tandem config show: {problem}", file=sys.stderr)
    if problems:
        return 2
    print(text, end="")
    return 0


def annotated(text: str, tree: UpTree, origin: bool) -> str:
    """`render`'s text as `config show` prints it: each value that stands for another shown as
    the one the run uses (the given one in a comment) and, with `origin`, where each set value
    came from."""
    used, out, section = resolved(tree), [], ""
    for line in text.splitlines():
        key, equals, _ = line.partition(" = ")
        if line.startswith("["):
            section = line.strip("[]")
        if not equals or line.startswith("#"):
            out.append(line)
            continue
        notes = []
        if (section, key) in used:
            value, why = used[section, key]
            line, notes = f"{key} = {toml_value(value)}", [why]
        if origin:
            notes.append(origin_of(tree, section, key))
        out.append(line + (f"  # {'; '.join(notes)}" if notes else ""))
    return "\n".join(out) + "\n"


def resolved(tree: UpTree) -> dict[tuple[str, str], tuple[Any, str]]:
    """(section, key) -> (the value the run uses, why) for each value given as a stand-in; one
    only a service's start knows is shown as given, saying what it stands for."""
    from tandem.up_launch import MODEL_DEFAULTS

    up, router, trainer = tree.up, tree.router, tree.trainer
    whose = "a --model's" if up.run.model else "the toy model's"
    out: dict[tuple[str, str], tuple[Any, str]] = {
        ("up", name): (up.by_model(name), f"given {getattr(up, name):g}: {whose} default")
        for name in MODEL_DEFAULTS
        if name != "lr" and up.unset(name)
    }
    if router.rollout.max_buffer_depth < 0:
        out["router", "max_buffer_depth"] = (router.buffer_depth_bound(), "given -1: 4 batches")
    if router.reward.rm_workers < 0:
        cores = "given -1: one per CPU core here, up to 8"
        out["router", "rm_workers"] = (router.reward.reward_workers(), cores)
    if not router.sampling.rollout_max_response_len:  # (the task's: known once it is loaded)
        task = "4 for the toy task, 1024 for a dataset or an environment, cut at the context"
        out["router", "rollout_max_response_len"] = (0, f"the router's start sets it: {task}")
    if not tree.value("engine", "context_length"):
        out["engine", "context_length"] = (0, "the model's max_position_embeddings")
    optimizer, steps = trainer.optimizer, trainer.batch.max_steps
    if not optimizer.lr_decay_iters and steps:
        out["trainer", "lr_decay_iters"] = (steps, "given 0: max_steps")
    if not optimizer.critic_lr:
        out["trainer", "critic_lr"] = (optimizer.lr, "given 0: lr")
    return out


def origin_of(tree: UpTree, section: str, key: str) -> str:
    """Where a value of `section` came from, as `config show --origin` says it."""
    from tandem.up_tree import UP_DEFAULTS

    where = tree.origins.get(section, {}).get(key, "default")
    named = key.replace("_", "-")
    if where == "file":
        return f"from {tree.config} [{section}] {key}"
    if where == "env":
        return f"from TANDEM_{section.upper()}_{key.upper()}"
    if where == "flag":
        return f"from --{named}" if section == "up" else f"from --{section}.{named} (or --{named})"
    ups = {
        *UP_DEFAULTS.get(section, {}),
        *{"trainer": ["lr"], "engine": ["device"]}.get(section, []),
    }
    return "tandem up's default" if key in ups else "default"


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

With `tandem up`, its configuration is its own `[up]` table (the run folder, processes and GPUs,
restarts, bounds and the goal, and the run terms: `model`, `seed`, the batch terms,
`max_staleness`, `weight_transport`) and each service's own table, composed: a service setting
is a flag of `tandem up` too, bare where one service alone has it (`--rollout-temperature 0.7`,
`--lr 1e-5`, `--kv-cache-gb 8`) or with the service's name, which always works
(`--router.rollout-temperature 0.7`; needed where services share a name:
`--trainer.num-threads 4`); a key of its table; or its `TANDEM_<SERVICE>_<KEY>` variable. The
run terms are `[up]`'s, filled into each service: a service table, variable or named flag that
gives one another value is refused, naming both. What `tandem up` sets per run (the run id,
addresses, ports, ready files) is refused in a service's table. `tandem up`'s own defaults for
the trainer: `max_steps = 300`, `save_interval = 10`, `keep_last_checkpoints = 2` (also
`--keep-checkpoints`), `lr` 1e-3 for the toy model and 1e-6 for a `--model`, checkpoints in
`RUN_DIR/checkpoints`; the engines' `device` (also `--engine-device`) is cuda with
`--engine-gpus`, else cpu. Each service it starts reads its resolved section from
`RUN_DIR/<service>.toml`.

`tandem config show [--config FILE] [flags]` prints the resolved configuration (nothing
starts): a value that stands for another (`-1`: the model's default) as the one the run uses,
with the given one in a comment; `--origin` adds where each value comes from (default, tandem
up's default, the file's table and key, an environment variable, a flag). Every `tandem up` run folder gets it as `config.toml`, and each service reads its table
from there; `tandem up --config RUN_DIR/config.toml` repeats the run (in a new folder). Keys
written as comments there are set by `tandem up` itself.

```toml
[up]
model = "/models/Qwen3-0.6B"
engine_gpus = [0]
trainer_gpus = [0]

[router]
prompt_data = "data/train.jsonl"
custom_rm_path = "rewards.py:score"
rollout_max_response_len = 1024
apply_chat_template = true

[trainer]
bf16 = true

[engine]
kv_cache_gb = 8.0
```
"""

SECTIONS_TEXT = {
    "up": "`tandem up`: the whole loop on one machine. It starts its own Redis unless given one "
    "(`redis_url`, or the variable REDIS_URL); `model` also takes a hub id (ORG/NAME) the Hugging "
    "Face cache holds; without one, the toy model made from `seed`.",
    "router": "`tandem router`: rollout router.",
    "trainer": "`tandem trainer`: megatron-core RL trainer.",
    "broker": "`tandem broker`: weight broker.",
    "engine": "`tandem engine`: reference inference engine.",
}


def reference() -> str:
    """docs/configuration.md: every table's keys with flag, default and meaning."""
    from tandem.up_launch import UpConfig
    from tandem.up_tree import SERVICES

    out = [INTRO]
    classes: dict[str, type[Any]] = {"up": UpConfig, **SERVICES}
    for name, cls in classes.items():
        out.append(f"\n## [{name}]\n\n{SECTIONS_TEXT[name]}\n")
        defaults = flat(cls())
        for group in parser(cls, f"tandem {name}")._action_groups:
            actions = [a for a in group._group_actions if a.dest not in ("help", "config")]
            if not actions:
                continue
            if group.title not in ("options", "optional arguments", "general"):
                out.append(f"\n### {group.title}\n")
            out.append("\n| key | flag | default | meaning |\n| --- | --- | --- | --- |")
            for action in actions:
                out.append(_row(action, defaults[action.dest]))
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def _row(action: object, default: object) -> str:
    """One key's row: key, flag, default, meaning (its help without the default it states)."""
    help_text = str(getattr(action, "help", "") or "")
    meaning = help_text.rsplit(" (default: ", 1)[0] if help_text.endswith(")") else help_text
    choices = getattr(action, "choices", None)
    if choices:
        meaning += f" One of: {', '.join(toml_value(c) if c == '' else str(c) for c in choices)}."
    shown = "not set" if default is None else toml_value(default)
    flag = getattr(action, "option_strings", [""])[0]
    row = [f"`{getattr(action, 'dest', '')}`", f"`{flag}`", f"`{shown}`"]
    return "| " + " | ".join([*row, meaning.replace("|", "\\|")]) + " |"
