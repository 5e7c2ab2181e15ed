"""`tandem metrics`: print the metrics records of a run from its Redis stream.

For any run: `--redis-url URL --run-id ID` (services started by hand or by a scheduler), or a
`tandem up` run folder. One line per record (time, source, step, then the values), or
`--json` lines as in `metrics.jsonl` (strict JSON: a NaN value is null); `--follow` waits for new records until Ctrl-C.
`--keys PATTERN` (fnmatch, repeatable) keeps only the matching values. Exit codes: 0 = records
printed, 1 = the stream is empty or Redis does not answer, 2 = the flags name no run.
"""

from __future__ import annotations

import argparse
import fnmatch
import time

import redis

from proto import MetricsRecord, decode
from services.sample_buffer.keys import BufferKeys
from tandem.progress import json_row
from tandem.run_redis import add_run_args, nothing_there, read_run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem metrics",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_args(parser)
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table.")
    parser.add_argument("--follow", "-f", action="store_true", help="Wait for new records.")
    parser.add_argument("--keys", action="append", default=[], help="Only values matching this.")
    parser.add_argument("--source", default="", help="Only records of this source (trainer...).")
    return parser


def format_record(record: MetricsRecord, keys: list[str], as_json: bool) -> str:
    values = {
        k: v
        for k, v in record.values.items()
        if not keys or any(fnmatch.fnmatch(k, p) for p in keys)
    }
    if as_json:  # (strict JSON: a NaN is null, as in metrics.jsonl)
        return json_row(
            {"source": record.source, "step": record.step, "time": record.time, **values}
        )
    stamp = time.strftime("%H:%M:%S", time.localtime(record.time))
    cells = " ".join(f"{k}={v:.4g}" for k, v in sorted(values.items()))
    return f"{stamp} {record.source:<8} step {record.step:>5} | {cells}"


def print_records(client: redis.Redis, key: str, args: argparse.Namespace) -> int:
    """Print every record after the start; with --follow keep waiting. Returns records seen."""
    last, seen = "0", 0
    while True:
        reply = client.xread({key: last}, count=1000, block=1000 if args.follow else None)
        entries = reply[0][1] if reply else []
        for entry_id, fields in entries:
            last = entry_id
            record = decode(fields[b"d"], MetricsRecord)
            if args.source and record.source != args.source:
                continue
            seen += 1
            print(format_record(record, args.keys, args.json), flush=True)
        if not entries and not args.follow:
            return seen


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def read(client: redis.Redis, run_id: str, where: str) -> int:
        key = BufferKeys(run_id).metrics_key
        try:
            if print_records(client, key, args):
                return 0
        except KeyboardInterrupt:  # (a reader that left, `| head`: tandem/cli.py's to end)
            return 0
        return nothing_there(
            "metrics", client, f"records in {key} at {where}", "metrics", "metrics"
        )

    return read_run("metrics", args, read)
