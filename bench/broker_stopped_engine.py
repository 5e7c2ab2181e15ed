"""One engine stopped (SIGSTOP: a hung GPU or host) while the trainer sends versions: seconds
from each version's send to the running engine serving it, and to `version:engines` (the
router's gate) following it. The broker as a process, two stand-in engines
(tests/fake_engine.py: real HTTP, real ZMQ fetch), a real Valkey server.

Before engines were synced independently, the version after the stopped engine's first missed
one waited for its `--sync-timeout-s` (60 s by default): the whole run froze that long.

    .venv/bin/python bench/broker_stopped_engine.py --sync-timeout-s 10
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from services.weight_sync.zmq_transport import ZmqWeightSender
from tests.conftest import ServiceProcess
from tests.helpers import wait_until
from tests.test_broker_sync import weights


def served(url: str) -> str:
    return httpx.get(f"{url}/checksums").json()["version"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync-timeout-s", default="60")
    parser.add_argument("--versions", type=int, default=4)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    fake = [sys.executable, str(Path(__file__).resolve().parents[1] / "tests/fake_engine.py")]
    with RedisServer(log_dir=tmp / "redis") as redis:
        buffer = SampleBuffer(BufferConfig(redis.url, "bench"))
        good = ServiceProcess([], tmp, "good", program=fake)
        stopped = ServiceProcess([], tmp, "stopped", program=fake)
        flags = ["--port", "0", "--redis-url", redis.url, "--run-id", "bench"]
        flags += ["--engine-urls", good.url, stopped.url, "--sync-timeout-s", args.sync_timeout_s]
        broker = ServiceProcess(["broker", *flags], tmp, "broker")
        sender = ZmqWeightSender(broker.info["intake_endpoint"])
        sender.send(1, weights(1))
        wait_until(lambda: buffer.get_version("engines") == 1, "both engines on version 1")
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            for version in range(2, args.versions + 2):
                start = time.monotonic()
                sender.send(version, weights(version))
                wait_until(lambda v=version: served(good.url) == str(v), "the running engine", 600)
                served_s = time.monotonic() - start
                wait_until(lambda v=version: buffer.get_version("engines") >= v - 1, "gate", 600)
                print(
                    f"version {version}: the running engine serves it after {served_s:.2f} s; "
                    f"version:engines >= {version - 1} after {time.monotonic() - start:.2f} s",
                    flush=True,
                )
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
            sender.close()
            for service in (broker, good, stopped):
                service.stop()


if __name__ == "__main__":
    main()
