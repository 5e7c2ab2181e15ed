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
import json
import sys

import redis

from services.sample_buffer.timeline import chrome_trace, read_spans
from tandem.run_redis import RunNotFoundError, add_run_args, known_runs, open_run


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
    try:
        with open_run(args) as (client, run_id, where):
            spans = read_spans(client, run_id)
            if not spans:
                runs = ", ".join(known_runs(client, "timeline")) or "none"
                print(
                    f"tandem timeline: no spans for run {run_id!r} at {where} (runs with a "
                    f"timeline there: {runs}); check --run-id",
                    file=sys.stderr,
                )
                return 1
    except RunNotFoundError as exc:
        print(f"tandem timeline: {exc}", file=sys.stderr)
        return 2
    except redis.RedisError as exc:
        print(f"tandem timeline: Redis did not answer ({exc}); check --redis-url", file=sys.stderr)
        return 1
    by_source = collections.Counter(s["source"] for s in spans)
    counts = ", ".join(f"{n} {source}" for source, n in sorted(by_source.items()))
    if args.output == "-":  # (it wrote a file named '-')
        json.dump(chrome_trace(spans), sys.stdout)
        print(f"\n{len(spans)} spans ({counts})", file=sys.stderr)
        return 0
    try:
        with open(args.output, "w") as out:
            json.dump(chrome_trace(spans), out)
    except OSError as exc:
        print(f"tandem timeline: cannot write --output {args.output}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {len(spans)} spans ({counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
