"""`tandem`: one command, one subcommand per service.

Each service parses its own flags (`tandem SERVICE --help`); this module only dispatches, so a
service's imports (torch, megatron) load only when that service runs.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading

COMMANDS = {
    "up": ("tandem.launcher", "run the whole async RL loop on this machine (all services)"),
    "engine": ("services.engine.__main__", "reference inference engine (SGLang HTTP API)"),
    "router": ("services.rollout_router.__main__", "rollout router: balancing, rollouts, API"),
    "trainer": ("services.trainer.__main__", "megatron-core RL trainer"),
    "broker": ("services.weight_broker.__main__", "weight broker: trainer -> engines"),
    "ledger": ("tandem.ledger_cli", "where every generated group of a run went (balanced?)"),
    "convert": ("services.trainer.convert", "Hugging Face <-> megatron checkpoint conversion"),
    "config": ("tandem.config_cmd", "print the resolved configuration (show) or its reference"),
    "toy-model": ("tandem.toy_model_cli", "write the built-in tiny model as a HF directory"),
    "metrics": ("tandem.metrics_cli", "print a run's metrics records from Redis"),
    "timeline": ("tandem.timeline_cli", "write a run's timeline as Chrome-trace JSON"),
}

# Services `tandem up` runs: their process skips the interpreter's teardown at exit (`leave`).
SERVICES = {"engine", "router", "trainer", "broker"}

# Commands that only print (a reader that leaves early, `tandem ledger | head`, is no failure).
READERS = {"ledger", "config", "metrics", "timeline", "toy-model"}


def stdout_gone() -> None:
    """Standard output's reader has left (BrokenPipeError): what is left to write goes nowhere,
    the flush at exit included (it raised again, in a traceback, once the command was done)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def usage() -> str:
    lines = ["usage: tandem COMMAND [flags]   (tandem COMMAND --help for its flags)", ""]
    lines += [f"  {name:<10} {text}" for name, (_mod, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name, rest = (argv or ["--help"])[0], argv[1:]
    if name not in COMMANDS and name not in ("-h", "--help"):
        print(f"tandem: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    printing = name not in COMMANDS or name in READERS or bool({"-h", "--help"} & set(rest))
    try:
        if name not in COMMANDS:
            print(usage())
            return 0 if argv else 2
        return int(importlib.import_module(COMMANDS[name][0]).main(rest) or 0)
    except BrokenPipeError:
        if not printing:  # (a service's socket, not its console)
            raise
        stdout_gone()  # (a command that keeps its own exit code, tandem ledger's verdict, did)
        return 0
    finally:  # (here, where a reader that left is caught: at exit it was a traceback)
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            stdout_gone()


def leave(code: int) -> None:
    """End a service's process as Python's exit would (its threads joined, its atexit handlers
    run: logging flushed) but without freeing every module one by one: that teardown took ~1 s
    of CPU after each stop of an engine, with torch and transformers loaded."""
    threading._shutdown()  # type: ignore[attr-defined]  # (what Python's exit does first)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if sys.argv[1:2] and sys.argv[1] in SERVICES:
        leave(code)
    sys.exit(code)
