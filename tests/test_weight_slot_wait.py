"""The trainer's wait for a weight slot when an engine stops (SIGSTOP: a hung GPU or host)
holding the slot of the version it serves, while the other engine holds the newest: that slot
never frees, so the writer adds one after `GROW_AFTER_S` (it waited 10 s before: a whole run
stood still that long, bench/up_stopped_engine.py). Real slot files and locks, the stopped
engine a real process holding its slot's shared lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import torch

from proto import encode
from services.weight_sync.shm import GROW_AFTER_S, ShmSlots, read_slot

HOLD = """
import sys, time
from proto import WeightBucketHeader, decode
from services.weight_sync.shm import read_slot
header = decode(sys.stdin.buffer.read(), WeightBucketHeader)
views, lease = read_slot(header)
print("held", flush=True)
time.sleep(600)
"""


def test_a_slot_held_by_a_stopped_engine_costs_the_trainer_one_short_wait_not_ten_seconds(
    tmp_path,
) -> None:
    slots = ShmSlots(str(tmp_path))  # the trainer's settings (zmq_transport.ZmqWeightSender)
    first = slots.write(1, [("w", torch.full((4,), 1.0))])
    stopped = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False
    )
    try:
        assert stopped.stdin is not None and stopped.stdout is not None
        stopped.stdin.write(encode(first))
        stopped.stdin.flush()
        stopped.stdin.close()
        assert stopped.stdout.readline().strip() == b"held"
        os.kill(stopped.pid, signal.SIGSTOP)
        _views, serving = read_slot(slots.write(2, [("w", torch.full((4,), 2.0))]))
        done: list[str] = []
        writer = threading.Thread(
            target=lambda: done.append(slots.write(3, [("w", torch.full((4,), 3.0))]).shm_path)
        )
        started = time.monotonic()
        writer.start()
        writer.join(timeout=5 * GROW_AFTER_S + 2)  # (a bound, not a speed test: it was 10 s)
        waited = time.monotonic() - started
        assert done, f"version 3 not written after {waited:.1f}s: the writer still waits"
        assert done[0].endswith("-slot2")  # a third slot; the stopped engine keeps its own
        serving.release()
    finally:
        os.kill(stopped.pid, signal.SIGKILL)
        stopped.wait()
        slots.close()


def test_a_writer_called_after_the_grow_bound_adds_the_slot_without_waiting_again(
    tmp_path,
) -> None:
    """The bound counts from the newest version's write: a trainer whose step outlasted it (it
    waited for the groups a stopped engine held) adds the slot at once, so the stop costs it
    one bound, not the groups' wait and the bound after it."""
    grow_after_s = 5.0
    slots = ShmSlots(str(tmp_path), grow_after_s=grow_after_s)
    try:
        _views, stopped = read_slot(slots.write(1, [("w", torch.full((4,), 1.0))]))
        _views, serving = read_slot(slots.write(2, [("w", torch.full((4,), 2.0))]))
        time.sleep(grow_after_s + 0.2)  # the step after version 2, longer than the bound
        done: list[str] = []
        writer = threading.Thread(
            target=lambda: done.append(slots.write(3, [("w", torch.full((4,), 3.0))]).shm_path)
        )
        writer.start()
        writer.join(timeout=grow_after_s / 2)  # (a bound: it waited the whole 5 s again)
        assert done, "version 3 waited for the slot after the bound had passed"
        assert done[0].endswith("-slot2")
        stopped.release()
        serving.release()
    finally:
        writer.join()
        slots.close()
