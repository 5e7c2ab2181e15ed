"""`tandem ledger RUN`: where every generated group of a run went, and whether it balances.

RUN is a `tandem up` run folder: its live Redis when the run is going (`RUN/redis.url`; the
`--redis-url` it ran on, `RUN/redis.json`), else a private server started on its data
(`RUN/redis/`), else the `RUN/ledger.json` written when the run ended (a Redis that refuses the
connection is not waited for: a killed `tandem up` leaves RUN/redis.url behind). Or name the
Redis yourself: `--redis-url URL --run-id ID`. Prints the counts by fate and by drop reason, each
reason with its newest drop's detail (why), and "balanced" or the difference. Exit codes: 0 =
balanced, 1 = unbalanced, 2 = the flags name no run, or nothing answers there (no Redis, no
saved data).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from services.sample_buffer import BufferConfig, SampleBuffer, redis_url_problem
from services.sample_buffer.ledger import DETAIL_RECORDS, Ledger, with_details
from tandem.run_redis import REDIS_FILE, known_runs, no_answer, run_id_of, saved_redis

# A live trainer counts a rollout consumed, then trained: a reading between the two is off by
# that rollout for a moment, so an unbalanced reading of a live run is taken again.
LIVE_READS, LIVE_READ_GAP_S = 5, 0.3
# A Redis that takes the connection but does not answer (busy, loading its data) is asked again
# for this long: never start a second server on the data of one that is there.
LIVE_WAIT_S = 5.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(  # (the whole text: where it reads, and the exit codes)
        prog="tandem ledger", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("run", nargs="?", help="run folder of `tandem up`")
    parser.add_argument("--redis-url", default="", help="Redis of the run (instead of RUN)")
    parser.add_argument(
        "--run-id", "--run-name", default="", help="run id (default: the RUN folder's)"
    )
    parser.add_argument("--json", action="store_true", help="print the ledger as JSON")
    args = parser.parse_args(argv)
    run_dir = Path(args.run) if args.run else None
    run_id = args.run_id or (run_id_of(run_dir) if run_dir else "")
    if not run_id:
        parser.error("name a run folder, or --redis-url with --run-id")
    if args.redis_url and (problem := redis_url_problem(args.redis_url)):
        print(f"tandem ledger: {problem}", file=sys.stderr)  # (it was a ValueError traceback)
        return 2
    try:
        ledger = read_ledger(run_dir, args.redis_url, run_id)
    except (FileNotFoundError, ConnectionError) as exc:
        print(f"tandem ledger: {exc}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(ledger.as_dict(), indent=1) if args.json else ledger.table(), flush=True)
    except BrokenPipeError:  # (`tandem ledger | head`: the verdict is still the exit code)
        from tandem.cli import stdout_gone

        stdout_gone()
    return 0 if ledger.balanced else 1


def read_ledger(run_dir: Path | None, redis_url: str, run_id: str) -> Ledger:
    """The ledger from the first source that answers (see the module docstring); a message
    on stderr when the run's own Redis is gone and its saved data is read instead."""
    own = live_url(run_dir)
    url = redis_url or external_url(run_dir) or own
    why = no_answer(url, LIVE_WAIT_S) if url else ""
    if url and not why:
        return read_live(SampleBuffer(BufferConfig(redis_url=url, run_id=run_id)))
    if url != own:  # (no data of that Redis here to read instead)
        raise ConnectionError(f"the Redis at {url} is {why}: start it, or check --redis-url")
    assert run_dir is not None
    gone = f"the run's Redis at {url} is {why}: its tandem up was stopped or killed" if url else ""
    if (run_dir / "redis").is_dir():
        if gone:
            print(
                f"tandem ledger: {gone}; reading its saved data ({run_dir}/redis)", file=sys.stderr
            )
        with saved_redis(run_dir) as server:
            buffer = SampleBuffer(BufferConfig(redis_url=server.url, run_id=run_id))
            return check_run(buffer, f"{run_dir}/redis").ledger(details=True)
    saved = run_dir / "ledger.json"
    if saved.is_file():
        fields = json.loads(saved.read_text())
        return Ledger(**{k: v for k, v in fields.items() if k in Ledger.__dataclass_fields__})
    if gone:
        raise ConnectionError(
            f"{run_dir}: {gone}, and it holds no redis/ data or ledger.json to read instead: "
            "pass --redis-url and --run-id of a Redis that holds the run"
        )
    raise FileNotFoundError(
        f"{run_dir} has no redis/ folder and no ledger.json: is it a `tandem up` run folder? "
        "(or pass --redis-url and --run-id)"
    )


def external_url(run_dir: Path | None) -> str:
    """The Redis a `tandem up --redis-url` run used ("" for a run with its own)."""
    info = run_dir / REDIS_FILE if run_dir else None
    if info is None or not info.is_file() or (saved := json.loads(info.read_text()))["own"]:
        return ""
    return str(saved["url"])


def live_url(run_dir: Path | None) -> str:
    """The URL of the run's own Redis while `tandem up` runs it ("" when there is none); a
    `tandem up` that was killed left it behind, its server gone."""
    path = run_dir / "redis.url" if run_dir else None
    return path.read_text().strip() if path is not None and path.is_file() else ""


def check_run(buffer: SampleBuffer, where: str) -> SampleBuffer:
    """`buffer`, or FileNotFoundError naming the runs there when its run id has neither a run
    contract nor counters (a mistyped --run-id read as an empty, balanced run before)."""
    if buffer.redis.exists(buffer.contract_key, buffer.counters_key):
        return buffer
    runs = ", ".join(known_runs(buffer.redis, "contract")) or "none"
    raise FileNotFoundError(
        f"no run {buffer.config.run_id!r} at {where} (runs there: {runs}); check --run-id "
        "(or --redis-url)"
    )


def read_live(buffer: SampleBuffer) -> Ledger:
    buffer.wait_ready(timeout_s=10.0)
    ledger = check_run(buffer, buffer.config.redis_url).ledger()
    for _ in range(LIVE_READS - 1):
        if ledger.balanced:
            break
        time.sleep(LIVE_READ_GAP_S)
        ledger = buffer.ledger()
    return with_details(ledger, buffer.drop_log(DETAIL_RECORDS))  # (once, for the reading shown)
