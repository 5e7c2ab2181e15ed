"""`tandem`: one command, one subcommand per service.

Each service parses its own flags (`tandem SERVICE --help`); this module only dispatches, so a
service's imports (torch, megatron) load only when that service runs.
"""

from __future__ import annotations

import importlib
import sys

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


def usage() -> str:
    lines = ["usage: tandem COMMAND [flags]   (tandem COMMAND --help for its flags)", ""]
    lines += [f"  {name:<10} {text}" for name, (_mod, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"tandem: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
