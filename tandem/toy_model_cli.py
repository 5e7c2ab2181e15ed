"""`tandem toy-model --out DIR`: write the built-in tiny model as a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem toy-model",
        description="Write the built-in tiny Llama (random init from --seed, ~100k parameters, "
        "16-token character tokenizer) as a Hugging Face directory: config.json, "
        "model.safetensors, tokenizer.json. Nothing is downloaded.",
    )
    parser.add_argument("--out", required=True, help="directory to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args(argv)
    from tandem.toy_model import write_toy_model

    try:
        path = write_toy_model(
            args.out, seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers
        )
    except OSError as exc:
        print(f"tandem toy-model: cannot write --out {args.out}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
