"""A store rolled back with its mark (an older snapshot restored, a failover to a replica that
lagged): the run's mark is still there, but the counters the run relies on went back, so a run
that went on would draw prompts and train groups twice. Each member stops as for a lost mark,
naming the counters and what `--resume` does. Real Valkey server processes on loopback (the
second started on a copy of the first's append-only files), a trainer's membership as a process."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from services.sample_buffer.keys import LEASE_RENEW_S
from tests.helpers import wait_until
from tests.test_store_faults import TRAINER_MEMBER


def test_a_store_rolled_back_to_an_older_snapshot_stops_the_trainer_with_exit_1_naming_the_counters(
    tmp_path: Path,
) -> None:
    server = RedisServer(log_dir=tmp_path / "log", data_dir=tmp_path / "data").start()
    url, run = server.url, "rolled-back"
    buffer = SampleBuffer(BufferConfig(url, run))
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_MEMBER, url, run],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    older = None
    try:
        assert trainer.stdout is not None
        wait_until(lambda: trainer.stdout.readline().strip() == "joined", "the trainer to join")
        buffer.incr_counter("prompts_drawn", 10)
        buffer.incr_counter("groups_put", 10)
        shutil.copytree(tmp_path / "data", tmp_path / "snapshot")  # the run at 10 draws
        buffer.incr_counter("prompts_drawn", 40)
        time.sleep(3 * LEASE_RENEW_S)  # (the member reads the counters at each renewal)
        port = server.port
        server.stop()
        older = RedisServer(port=port, log_dir=tmp_path / "log", data_dir=tmp_path / "snapshot")
        older.start()
        assert SampleBuffer(BufferConfig(url, run)).counters()["prompts_drawn"] == 10
        said = trainer.communicate(timeout=60)[0]
    finally:
        trainer.kill()
        server.stop()
        if older is not None:
            older.stop()
    assert trainer.returncode == 1, said
    assert "lost this run's state (its counters went back (prompts_drawn 50 -> 10" in said, said
    assert "groups_put" not in said.split("went back")[1].split(":")[0]  # (it did not)
    assert "tandem up --resume" in said


WATCHING_TRAINER = TRAINER_MEMBER.replace(
    'print("joined"', 'member.watch("groups_consumed", "groups_trained")\nprint("joined"'
)


def test_a_trainers_trained_count_gone_back_stops_it_with_exit_1_naming_the_counter(
    tmp_path: Path,
) -> None:
    """The counts only the trainer moves (once its resume rewound them: `Trainer` watches them
    then) are checked too, though the run-wide ones stand still (no router running)."""
    with RedisServer(log_dir=tmp_path / "log") as server:
        buffer = SampleBuffer(BufferConfig(server.url, "edited"))
        buffer.incr_counter("groups_trained", 40)
        trainer = subprocess.Popen(
            [sys.executable, "-c", WATCHING_TRAINER, server.url, "edited"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert trainer.stdout is not None
            wait_until(lambda: trainer.stdout.readline().strip() == "joined", "the join")
            time.sleep(3 * LEASE_RENEW_S)  # (the member reads the counters at each renewal)
            buffer.set_counter("groups_trained", 10)
            said = trainer.communicate(timeout=60)[0]
        finally:
            trainer.kill()
    assert trainer.returncode == 1, said
    assert "its counters went back (groups_trained 40 -> 10" in said, said
