"""The run folder of `tandem up`: its default name, one run at a time in it (a lock), what to
say when the disk under it is full, the run's secrets (the API token kept there) and its
summary; and the flag Ctrl-C and SIGTERM set."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import psutil
from redis.exceptions import RedisError

from services.common.auth import TOKEN_ENV, TOKEN_FILE
from services.sample_buffer import SampleBuffer
from services.sample_buffer.timeline import chrome_trace, read_spans
from services.weight_sync.wire import SECRET_ENV
from tandem.sinks import say

WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)  # of the run folder
LOW_DISK_BYTES = 16 << 20


class DiskWatch:
    """Says, once, when the disk holding the run folder is (nearly) full: a service that dies
    there may not have been able to write why into its log."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.said = run_dir, False

    def note(self) -> str:
        """The sentence (with a leading newline) the first time the disk is full, else ""."""
        try:
            free = shutil.disk_usage(self.run_dir).free
        except OSError:
            return ""
        if self.said or free >= LOW_DISK_BYTES:
            return ""
        self.said = True
        run_dir = self.run_dir
        return (
            f"\nthe disk holding {run_dir} is full ({free >> 10} KiB free): free space there "
            f"(df -h {shlex.quote(str(run_dir))}) and go on with {resume_command(run_dir)}, or "
            "start again "
            "with --run-dir on a disk with room"
        )


def resume_command(run_dir: Path | str) -> str:
    """The command that continues the run in `run_dir`, quoted for a shell."""
    return f"tandem up --resume {shlex.quote(str(run_dir))}"


class RunDirBusyError(RuntimeError):
    """Another `tandem up` runs in this run folder."""


def lock_run_dir(run_dir: Path, resume: bool = False) -> IO[str]:
    """RUN_DIR/up.lock, locked while this `tandem up` lives (the kernel drops the lock when the
    process ends, however it ends): a second run in the same folder would start a second Redis
    on the same data and services writing the same checkpoints. With `resume`, the services of
    an earlier launch still running are refused too (`left_running`)."""
    lock = open(run_dir / "up.lock", "a+")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise RunDirBusyError(
            f"{run_dir} is in use by another tandem up (pid {holder}): stop it first (Ctrl-C "
            "there), or give another --run-dir"
        ) from None
    if resume and (running := left_running(run_dir)):
        lock.close()
        raise RunDirBusyError(running)
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def left_running(run_dir: Path) -> str:
    """The services of an earlier launch in `run_dir` that still run ("" when none): a
    `tandem up` killed by SIGKILL leaves them stopping (the trainer saves its checkpoint) or,
    stopped themselves, running on; a resume beside them would start a second set on the same
    checkpoints. Found by the run's config.toml on their command lines."""
    config, found = str(run_dir.absolute() / "config.toml"), []
    for process in psutil.process_iter(["cmdline"]):
        words = process.info["cmdline"] or []
        if config in words and process.pid != os.getpid():
            role = words[3] if words[1:3] == ["-m", "tandem.cli"] and len(words) > 3 else words[0]
            found.append(f"{role} (pid {process.pid})")
    if not found:
        return ""
    return (
        f"{run_dir}: services of an earlier launch still run: {', '.join(found)}; wait for them "
        f"to stop (a trainer saves its checkpoint first), or end them (kill PID), then resume"
    )


def share_run_secrets(run_dir: Path) -> str:
    """A per-run API token (every mutating route) and weight-frame secret (HMAC of every weight
    bucket), inherited by every child; values already in the environment are kept. A token made
    here goes to RUN_DIR/api_token (owner-only), for the dashboard's and the API's writes.
    Returns where the token is."""
    yours = TOKEN_ENV in os.environ
    for name in (TOKEN_ENV, SECRET_ENV):
        os.environ.setdefault(name, secrets.token_hex(32))
    if yours:
        return f"${TOKEN_ENV}"
    path = run_dir / TOKEN_FILE
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        out.write(os.environ[TOKEN_ENV] + "\n")
    path.chmod(0o600)  # (a file of an earlier run may have other modes)
    return str(path)


def default_run_dir(seed: int) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-seed{seed}"


def write_summary(run_dir: Path, summary: dict) -> None:
    def clean(value: object) -> object:
        return None if isinstance(value, float) and math.isnan(value) else value

    (run_dir / "summary.json").write_text(
        json.dumps({k: clean(v) for k, v in summary.items()}, indent=2)
    )


class Console:
    """sys.stdout or sys.stderr of `tandem up`: once a write fails (the terminal closed, the
    pipe's reader gone: `tandem up | head`), the rest goes nowhere and `on_lost` is called
    (the run then stops as on Ctrl-C: it crashed at the failed write, its summary unwritten)."""

    def __init__(self, stream: IO[str], on_lost: Callable[[], None]) -> None:
        self.stream, self.on_lost = stream, on_lost

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            self._lost()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError:
            self._lost()

    def _lost(self) -> None:
        self.stream = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
        self.on_lost()

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)


def install_interrupt_handler(flag: list[bool]) -> None:
    """Ctrl-C, SIGTERM, SIGHUP (the terminal closed) and a console that can no longer be
    written set a flag the monitor loop checks (children are stopped there)."""

    def handler(signum: int, _frame: object) -> None:
        flag.append(True)

    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, handler)
    sys.stdout = Console(sys.stdout, lambda: flag.append(True))  # type: ignore[assignment]
    sys.stderr = Console(sys.stderr, lambda: flag.append(True))  # type: ignore[assignment]


# The run's saved configuration: tandem/up_args.py's CONFIG_FILE, tandem/up_config.py's
# RUN_CONFIG (which import this module).
SAVED_CONFIGURATION = ("up_config.json", "config.toml")


def kept_configuration(run_dir: Path) -> dict[Path, bytes | None]:
    """The bytes of each file of SAVED_CONFIGURATION in `run_dir` (None: there is none), for
    `restore_files`."""
    paths = [run_dir / name for name in SAVED_CONFIGURATION]
    return {path: path.read_bytes() if path.is_file() else None for path in paths}


def restore_files(kept: dict[Path, bytes | None]) -> str:
    """The files of `kept_configuration` as they were (one that was not there removed); what
    to say of it ("" when `kept` is empty)."""
    for path, data in kept.items():
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(data)
    names = " and ".join(path.name for path in kept)
    return f"the resume did not start: {names} are as they were before it" if kept else ""


def write_timeline(buffer: SampleBuffer, run_id: str, run_dir: Path) -> None:
    """RUN_DIR/timeline.json: the run's spans as a Chrome trace (ui.perfetto.dev opens it)."""
    try:
        spans = read_spans(buffer.redis, run_id)
    except RedisError as exc:
        say(f"no timeline.json: Redis did not answer ({exc})")
        return
    (run_dir / "timeline.json").write_text(json.dumps(chrome_trace(spans)))
