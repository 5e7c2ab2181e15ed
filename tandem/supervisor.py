"""Supervisor: start service processes, wait for them to be ready, stop them all.

Every child runs in its own process group (so a terminal's Ctrl-C reaches only the launcher,
which then stops children in reverse order) and is asked by the kernel to die with SIGTERM if
the launcher itself dies (PR_SET_PDEATHSIG), so nothing is left running in any case.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
# A service imports Tandem's `proto`, `services` and `tandem` from this checkout or install,
# never from the directory `tandem up` runs in: `python -m` would put that directory first on
# sys.path, and a `services/` or `proto/` folder of the user's project would shadow ours
# (PYTHONSAFEPATH; the checkout stays importable where Tandem is not installed).
ROOT = Path(__file__).resolve().parents[1]


def child_env(extra: dict[str, str] | None) -> dict[str, str]:
    """A service's environment: ours, Tandem's packages first (see ROOT), and `extra`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    safe = {"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1", "PYTHONPATH": path}
    return {**os.environ, **safe, **(extra or {})}


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when its parent exits."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the launcher's own cleanup still runs
        pass


class ChildFailedError(RuntimeError):
    """A child exited (or never became ready); the message carries its log tail, `code` the
    child's exit code (None: it did not exit)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_file: Path | None
    info: dict
    env: dict[str, str] | None = None

    def log_tail(self, chars: int = 3000) -> str:
        """The log's last lines, about `chars` bytes of them, read from its end (a long run's
        log is large), from a line's start."""
        try:
            with self.log_path.open("rb") as log:
                start = max(log.seek(0, os.SEEK_END) - chars, 0)
                log.seek(start)
                data = log.read()
        except FileNotFoundError:
            return ""
        if start and b"\n" in data[:-1]:
            data = data[data.index(b"\n") + 1 :]
        return data.decode(errors="replace")

    def last_line(self, chars: int = 3000) -> str:
        """The log's last line that is not blank ("" when there is none)."""
        lines = [line.strip() for line in self.log_tail(chars).splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def how_it_ended(self) -> str:
        """'exited with code N', or 'was killed by SIGNAL' (SIGKILL: out of memory?)."""
        code = self.proc.returncode
        if code == 0:  # (a service stops with 0 on SIGTERM, SIGINT or SIGHUP: it said nothing)
            return "exited with code 0 (stopped by a signal tandem up did not send: kill?)"
        if code is None or code > 0:
            return f"exited with code {code}"
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return f"was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")

    def exit_reason(self) -> str:
        """Why the child exited: its own one-line error when it ended on one (every service
        ends a failure it understands with `tandem NAME: what to fix`), else its log's tail
        (a traceback before that line is in the log, not on the console)."""
        last = self.last_line()
        return last if re.match(r"tandem [\w-]+: ", last) else self.log_tail()


class StartInterruptedError(RuntimeError):
    """Ctrl-C or SIGTERM while a child was starting: stop now, not after every start-up."""


# How often `tandem up` says which service it is still waiting for at start-up (a real model's
# engine may load for minutes).
STARTING_NOTE_S = 30.0


KEPT_LOGS = 3  # earlier launches' logs of a service kept (NAME.log.1 the newest of them)


def keep_earlier_logs(log_path: Path) -> None:
    """An earlier launch's log (that of the run a --resume goes on from: what went wrong is
    in it) moved to NAME.log.1, the older ones one further, the oldest past KEPT_LOGS gone;
    it was written over. A process of that launch still running writes on into its own."""
    if not log_path.is_file():
        return
    for n in range(KEPT_LOGS - 1, 0, -1):
        older = log_path.with_name(f"{log_path.name}.{n}")
        if older.exists():
            older.replace(log_path.with_name(f"{log_path.name}.{n + 1}"))
    log_path.replace(log_path.with_name(f"{log_path.name}.1"))


class Supervisor:
    def __init__(
        self,
        log_dir: Path,
        interrupted: list[bool] | None = None,
        note: Callable[[str], None] | None = None,
        note_every_s: float = STARTING_NOTE_S,
    ) -> None:
        """`interrupted`: a flag (non-empty = set) that ends `wait_ready` at once. `note` hears
        every `note_every_s` while a child starts, which one and its log's last line."""
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.interrupted = interrupted if interrupted is not None else []
        self.note, self.note_every_s = note, note_every_s

    def start(
        self,
        name: str,
        args: list[str],
        ready: bool = True,
        env: dict[str, str] | None = None,
        program: list[str] | None = None,
    ) -> Child:
        """Start `tandem ARGS` (or `PROGRAM ARGS`) as `name`; with `ready`, add
        `--ready-file` and wait for it in `wait_ready`. `env` adds to our environment."""
        ready_file = self.log_dir / f"{name}.ready.json" if ready else None
        cmd = [*(program or [sys.executable, "-m", "tandem.cli"]), *args]
        if ready_file is not None:
            cmd += ["--ready-file", str(ready_file)]
        keep_earlier_logs(self.log_dir / f"{name}.log")
        return self._spawn(name, cmd, ready_file, env, "wb")

    def restart(self, child: Child, more_args: list[str]) -> Child:
        """Start an exited child again, its command line with `more_args` (a later flag wins),
        its log appended to; it takes the old one's place (`wait_ready` or its ready file says
        when it is up)."""
        self.children.remove(child)
        cmd = [*child.proc.args, *more_args]  # type: ignore[misc]
        restarted = self._spawn(child.name, cmd, child.ready_file, child.env, "ab")
        restarted.info = dict(child.info)
        return restarted

    def _spawn(
        self,
        name: str,
        cmd: list[str],
        ready_file: Path | None,
        env: dict[str, str] | None,
        mode: str,
    ) -> Child:
        log_path = self.log_dir / f"{name}.log"
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        with open(log_path, mode) as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
                env=child_env(env),
            )
        child = Child(name, proc, log_path, ready_file, {}, env)
        self.children.append(child)
        return child

    def wait_ready(self, children: list[Child], timeout_s: float) -> None:
        """Wait until each child wrote its ready file; raise ChildFailedError naming the first
        child that exited or timed out, with its log tail (StartInterruptedError on Ctrl-C)."""
        started = time.monotonic()
        deadline, noted = started + timeout_s, started
        for child in children:
            assert child.ready_file is not None
            while not child.ready_file.exists():
                if self.note is not None and time.monotonic() - noted >= self.note_every_s:
                    noted = time.monotonic()
                    last = child.last_line(500) or "(empty)"
                    self.note(
                        f"{child.name} is still starting ({noted - started:.0f} s of "
                        f"{timeout_s:.0f}, --startup-timeout-s); its log's last line: "
                        f"{last[-200:]}"
                    )
                if self.interrupted:
                    raise StartInterruptedError(f"interrupted while {child.name} was starting")
                if child.proc.poll() is not None:
                    raise ChildFailedError(
                        f"{child.name} {child.how_it_ended()} during start-up "
                        f"(log: {child.log_path}):\n{child.exit_reason()}",
                        child.proc.returncode,
                    )
                if time.monotonic() > deadline:
                    raise ChildFailedError(
                        f"{child.name} was not ready after {timeout_s:.0f}s (tandem up's "
                        f"--startup-timeout-s; log: {child.log_path}):\n{child.log_tail()}"
                    )
                time.sleep(0.1)
            child.info = json.loads(child.ready_file.read_text())

    def exited(self) -> Child | None:
        """The first child that has exited, if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop_all(
        self,
        timeout_s: float = 10.0,
        on_slow: Callable[[list[str]], None] | None = None,
        slow_s: float = 5.0,
        first: tuple[str, ...] = (),
    ) -> list[str]:
        """SIGTERM every child's process group (newest first; the children named in `first`
        before the others, once they have exited or `timeout_s` has passed), then SIGKILL what
        is left of each group after `timeout_s`; returns the names of the children that had to
        be killed. `on_slow` hears once which children still run after `slow_s`; an interrupt
        (Ctrl-C) that comes meanwhile ends the wait at once. A child that already exited is
        signalled too: a service killed by SIGKILL leaves its own children (its session)
        behind otherwise."""
        started, interrupts = time.monotonic(), len(self.interrupted)
        deadline = started + timeout_s
        waves = [[c for c in self.children if c.name in first]]
        waves.append([c for c in self.children if c.name not in first])
        running: list[Child] = []
        for wave in waves:
            for child in reversed(wave):
                _signal_group(child.proc.pid, signal.SIGTERM)
            running += [c for c in wave if c.proc.poll() is None]
            while running and time.monotonic() < deadline and len(self.interrupted) == interrupts:
                if on_slow is not None and time.monotonic() - started >= slow_s:
                    on_slow([c.name for c in running])
                    on_slow = None
                time.sleep(0.05)
                running = [c for c in running if c.proc.poll() is None]
        for child in reversed(self.children):
            _signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
        return [c.name for c in running]


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
