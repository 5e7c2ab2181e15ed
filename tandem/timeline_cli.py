"""`tandem timeline`: write a run's timeline as a Chrome-trace JSON (open it in
ui.perfetto.dev or chrome://tracing): rollout batches and the rollout loop's waits (router), each
train step with its phases and waits for data (trainer), each engine's weight sync (broker).

For any run: `--redis-url URL --run-id ID`, or a `tandem up` run folder (which also gets
`timeline.json` when the run ends). Exit codes: 0 = written, 1 = no spans or Redis does not
answer, 2 = the flags name no run or an --output that cannot be written.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys

import redis

from services.sample_buffer.timeline import chrome_trace, read_spans
from tandem.run_redis import add_run_args, nothing_there, read_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem timeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_args(parser)
    parser.add_argument(
        "-o", "--output", default="timeline.json", help="File to write (- for standard output)."
    )
    args = parser.parse_args(argv)
    return read_run("timeline", args, functools.partial(write, output=args.output))


def write(client: redis.Redis, run_id: str, where: str, output: str) -> int:
    """The run's spans into `output` (- for standard output); its exit code."""
    spans = read_spans(client, run_id)
    if not spans:
        what = f"spans for run {run_id!r} at {where}"
        return nothing_there("timeline", client, what, "timeline", "a timeline")
    by_source = collections.Counter(s["source"] for s in spans)
    counts = ", ".join(f"{n} {source}" for source, n in sorted(by_source.items()))
    if output == "-":  # (it wrote a file named '-')
        json.dump(chrome_trace(spans), sys.stdout)
        print(f"\n{len(spans)} spans ({counts})", file=sys.stderr)
        return 0
    try:
        with open(output, "w") as out:
            json.dump(chrome_trace(spans), out)
    except OSError as exc:
        print(f"tandem timeline: cannot write --output {output}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {output}: {len(spans)} spans ({counts})")
    return 0
