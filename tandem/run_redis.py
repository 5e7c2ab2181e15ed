"""Find the Redis of a run for the read-only commands (`tandem metrics`, `tandem timeline`,
`tandem ledger`).

A run is named either by `--redis-url` and `--run-id` (any run, e.g. services started by
hand or by a cluster scheduler), or by a `tandem up` run folder: its `redis.json` says where its
Redis is (written at start-up). When that Redis was the run's own and is gone (the run ended),
a private server is started on the folder's saved data (`RUN_DIR/redis`) for the time of the
read, as `tandem up --resume` does. A Redis that refuses the connection is not asked again: its
process is gone (a killed `tandem up` leaves the URL of its Redis behind).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

from services.sample_buffer import RedisServer, redis_url_problem
from services.sample_buffer.password import PASSWORD_ENV, password_option, password_refusal
from tandem.supervisor import die_with_parent

REDIS_FILE = "redis.json"  # {"url", "run_id", "own"}, written by `tandem up`


def run_id_of(run_dir: Path, external: bool = False, new: bool = False) -> str:
    """The run id of a `tandem up` run folder: the one its `redis.json` records, else
    `up-<folder name>`. A new run on an `external` Redis (`--redis-url`, shared by runs) gets
    a suffix of its own: two run folders of one name (`a/run`, `b/run`) are two runs."""
    info = run_dir / REDIS_FILE
    if not new and info.is_file():
        return str(json.loads(info.read_text())["run_id"])
    name = f"up-{run_dir.resolve().name}"
    return f"{name}-{secrets.token_hex(3)}" if new and external else name


def saved_redis(run_dir: Path, log_dir: Path | None = None) -> RedisServer:
    """A private server on a run folder's saved data (`RUN_DIR/redis`), for the time of a
    read; it dies with the command that started it, even one killed with SIGKILL."""
    return RedisServer(log_dir=log_dir, data_dir=run_dir / "redis", preexec_fn=die_with_parent)


class RunNotFoundError(ValueError):
    """The flags do not name a run that can be read (exit code 2)."""


def add_run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", default="", help="A `tandem up` run folder.")
    parser.add_argument("--redis-url", default="", help="Redis of the run (instead of RUN_DIR).")
    parser.add_argument(
        "--run-id",
        "--run-name",
        dest="run_id",
        default="",
        help="The run's --run-id (its Redis key prefix tandem:RUN_ID:); with --redis-url.",
    )


def no_answer(url: str, wait_s: float = 0.0) -> str:
    """Why no Redis answers a ping at `url` ("" when one does): "not running (connection
    refused)", said at once (no server there to wait for), or "not answering (the error)" once
    `wait_s` has passed (a server that is busy or loading its data is asked again until then)."""
    client = client_of(url, socket_connect_timeout=1, socket_timeout=2)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.ping()
            return ""
        except redis.RedisError as exc:
            if isinstance(exc.__cause__, ConnectionRefusedError):
                return "not running (connection refused)"
            if isinstance(exc, redis.AuthenticationError):  # (said at once: waiting won't help)
                return f"refusing this client ({exc}; set {PASSWORD_ENV} to its password)"
            if time.monotonic() >= deadline:
                return f"not answering ({exc})"
        time.sleep(0.5)


def client_of(url: str, **options: float) -> redis.Redis:
    """A client of the Redis at `url` that sends TANDEM_REDIS_PASSWORD when it is set."""
    return redis.Redis.from_url(url, **options, **password_option())


@contextlib.contextmanager
def open_run(args: argparse.Namespace) -> Iterator[tuple[redis.Redis, str, str]]:
    """(client, run id, where) of the run named by the flags; raises RunNotFoundError, also
    for a Redis that refuses the password (naming TANDEM_REDIS_PASSWORD)."""
    where = args.redis_url
    try:
        with _open_run(args) as found:
            where = found[2]
            yield found
    except redis.AuthenticationError as exc:
        raise RunNotFoundError(str(password_refusal(where, exc))) from None


@contextlib.contextmanager
def _open_run(args: argparse.Namespace) -> Iterator[tuple[redis.Redis, str, str]]:
    if args.redis_url and (problem := redis_url_problem(args.redis_url)):
        raise RunNotFoundError(problem)  # (it was redis-py's ValueError traceback)
    if not args.run_dir:
        if not (args.redis_url and args.run_id):
            raise RunNotFoundError("name a run: RUN_DIR, or --redis-url URL and --run-id ID")
        yield client_of(args.redis_url), args.run_id, args.redis_url
        return
    run_dir = Path(args.run_dir)
    info_path = run_dir / REDIS_FILE
    if not info_path.is_file():
        raise RunNotFoundError(
            f"{run_dir}: no {REDIS_FILE} there (not a `tandem up` run folder); for other runs "
            "pass --redis-url and --run-id"
        )
    info = json.loads(info_path.read_text())
    run_id = args.run_id or info["run_id"]
    url = args.redis_url or info["url"]
    if not no_answer(url) or not info.get("own") or args.redis_url:
        yield client_of(url), run_id, url
        return
    if not (run_dir / "redis").is_dir():
        raise RunNotFoundError(f"{run_dir}: its Redis at {url} is gone and no redis/ data is left")
    with saved_redis(run_dir, run_dir / "logs" / "read") as server:
        yield client_of(server.url), run_id, f"{run_dir}/redis (saved data)"


def known_runs(client: redis.Redis, suffix: str) -> list[str]:
    """Run ids that have a `tandem:{id}:{suffix}` key (to name them when the one asked is empty)."""
    keys = client.scan_iter(match=f"tandem:*:{suffix}", count=1000)
    return sorted(k.decode()[len("tandem:") : -len(suffix) - 1] for k in keys)


def read_run(command: str, args: argparse.Namespace, read: Callable[..., int]) -> int:
    """`read(client, run_id, where)` on the run the flags name, and its exit code; 2 when they
    name no run, 1 when its Redis does not answer (each said on stderr)."""
    try:
        with open_run(args) as found:
            return read(*found)
    except RunNotFoundError as exc:
        print(f"tandem {command}: {exc}", file=sys.stderr)
        return 2
    except redis.RedisError as exc:
        print(f"tandem {command}: Redis did not answer ({exc}); check --redis-url", file=sys.stderr)
        return 1


def nothing_there(command: str, client: redis.Redis, what: str, suffix: str, holding: str) -> int:
    """Exit code 1, saying that the run holds no `what` and which runs there have some."""
    runs = ", ".join(known_runs(client, suffix)) or "none"
    print(
        f"tandem {command}: no {what} (runs with {holding} there: {runs}); check --run-id",
        file=sys.stderr,
    )
    return 1
