"""A `--custom-rm-path` function in worker processes (`--rm-workers`): a call that hangs, dies
or raises fails its own sample with a reason naming the flag, the router's event loop runs on
meanwhile, and the workers die with the router even while the function hangs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.rollout_router.config import RewardConfig
from services.rollout_router.rollout.rewards import Reward, RewardError, make_reward
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]

REWARD = '''
import os
import time


def score(text, label, stopped):
    """The reward of each text: see the test."""
    if text == "hang":
        time.sleep(3600)
    if text == "die":
        os._exit(3)
    if text == "boom":
        raise ZeroDivisionError("boom")
    if text == "nan":
        return float("nan")
    if text == "pid":
        return os.getpid()
    if text == "slow":
        time.sleep(0.5)
        return -1.0
    return float(len(text)) if stopped else 0.0
'''


def made(path: str, timeout_s: float, workers: int, max_errors_in_a_row: int = 0) -> Reward:
    """`make_reward` of a --custom-rm-path function from a blocking test (its first worker, if
    any, started)."""
    config = RewardConfig(
        custom_rm_path=path,
        rm_timeout_s=timeout_s,
        rm_workers=workers,
        rm_max_errors_in_a_row=max_errors_in_a_row,
    )
    return asyncio.run(make_reward(config, None))


@pytest.fixture
def reward_file(tmp_path: Path) -> str:
    (tmp_path / "reward.py").write_text(REWARD)
    return f"{tmp_path / 'reward.py'}:score"


async def max_gap_while(work: asyncio.Future, tick_s: float = 0.01) -> float:
    """The longest the event loop went without running this ticker while `work` ran."""
    gap, last = 0.0, time.monotonic()
    while not work.done():
        await asyncio.sleep(tick_s)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
    return gap


def test_each_failing_call_fails_its_own_sample_and_the_event_loop_runs_on(reward_file) -> None:
    reward = made(reward_file, 2.0, workers=2)
    texts = ["ok", "hang", "die", "boom", "nan", "four"]

    async def run() -> tuple[list[float | RewardError], float, list[float | RewardError]]:
        work = asyncio.ensure_future(reward.score_all("p", [(t, "stop") for t in texts], "l"))
        gap = await max_gap_while(work)
        after = await reward.score_all("p", [("again", "stop"), ("x", "length")], "l")
        assert reward.workers is not None
        for worker in reward.workers.idle:  # killed while idle: its next call says so
            worker.process.kill()
            worker.process.wait(5)
        after += await reward.score_all("p", [("a", "stop")] * len(reward.workers.idle), "l")
        after.append(await reward.score("p", "again", "l", "stop"))
        return work.result(), gap, after

    try:
        out, gap, after = asyncio.run(run())
    finally:
        reward.close()
    assert out[0] == 2.0 and out[5] == 4.0
    why = {
        t: (o.reason, str(o)) for t, o in zip(texts, out, strict=True) if isinstance(o, RewardError)
    }
    assert set(why) == {"hang", "die", "boom", "nan"}
    name = "reward function score"
    assert why["hang"] == (
        "reward_error",
        f"{name} did not return within 2s (--rm-timeout-s): its worker process was killed and "
        "is replaced",
    )
    assert why["die"] == ("reward_error", f"{name} ended its worker process (exit code 3)")
    assert why["boom"] == ("reward_error", f"{name} raised ZeroDivisionError: boom")
    assert why["nan"] == ("reward_nonfinite", f"{name} returned nan")
    # A call that hangs for 2 s would have stopped the loop for as long in the loop itself.
    assert gap < 1.0, f"the event loop stalled for {gap:.2f}s"
    assert after[:2] == [5.0, 0.0], "workers replaced: later calls are answered"
    ended = [str(e) for e in after[2:-1] if isinstance(e, RewardError)]
    assert ended and ended == [f"{name} ended its worker process (exit code -9)"] * len(after[2:-1])
    assert after[-1] == 5.0
    assert reward.workers is not None and not reward.workers.idle and not reward.workers.busy


def test_inline_functions_and_async_ones_keep_to_the_event_loop(reward_file) -> None:
    """--rm-workers 0 runs the function in the router's own process (no worker); an async
    function is bounded by the timeout there."""
    inline = made(reward_file, 2.0, workers=0)
    assert inline.workers is None
    assert asyncio.run(inline.score("p", "pid", "l", "stop")) == os.getpid()

    async def forever(text: str, label: str, stopped: bool) -> float:
        await asyncio.sleep(3600)
        return 1.0

    bounded = Reward(forever, timeout_s=0.2)
    [out] = asyncio.run(bounded.score_all("p", [("t", "stop")], "l"))
    assert isinstance(out, RewardError)
    assert str(out).endswith("did not return within 0.2s (--rm-timeout-s)")


def test_a_stop_signal_to_the_routers_process_group_leaves_a_call_in_flight_to_finish(
    reward_file,
) -> None:
    """tandem up stops the router with a SIGTERM to its process group, which holds the workers
    (a closed terminal sends SIGHUP): a call in flight still gets its value, and the router
    stops its workers itself. (The call was lost as reward_error, 'ended its worker process
    (exit code -15)', a moment before the router's stop cancelled it.)"""
    reward = made(reward_file, 10.0, workers=1)

    async def run() -> float:
        worker = int(await reward.score("p", "pid", "l", "stop"))
        slow = asyncio.ensure_future(reward.score("p", "slow", "l", "stop"))
        await asyncio.sleep(0.2)  # the worker is in the call (0.5 s)
        os.kill(worker, signal.SIGTERM)
        os.kill(worker, signal.SIGHUP)
        return await slow

    try:
        assert asyncio.run(run()) == -1.0
    finally:
        reward.close()


def test_workers_die_with_the_router_even_while_the_function_hangs(reward_file, tmp_path) -> None:
    """kill -9 of the router leaves no worker behind (Linux: the parent's death signals it)."""
    script = (
        "import asyncio, sys\n"
        "from services.rollout_router.rollout.rewards import make_reward\n"
        "from services.rollout_router.config import RewardConfig\n"
        f"config = RewardConfig(custom_rm_path={reward_file!r}, rm_timeout_s=3600.0, rm_workers=1)\n"
        "reward = asyncio.run(make_reward(config, None))\n"
        "async def main():\n"
        "    print(await reward.score('p', 'pid', 'l', 'stop'), flush=True)\n"
        "    await reward.score('p', 'hang', 'l', 'stop')\n"
        "asyncio.run(main())\n"
    )
    router = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert router.stdout is not None
        worker = int(float(router.stdout.readline()))
        time.sleep(0.5)  # the worker is in the hanging call
        os.kill(router.pid, signal.SIGKILL)
        router.wait(10)
        wait_until(
            lambda: not Path(f"/proc/{worker}").exists() or zombie(worker), "the worker's end", 10
        )
    finally:
        router.kill()


def zombie(pid: int) -> bool:
    """A dead process not yet reaped (its parent is gone: init reaps it soon)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_number_of_workers_defaults_to_the_cores_up_to_8() -> None:
    from services.rollout_router.config import RewardConfig

    assert RewardConfig().reward_workers() == min(os.cpu_count() or 1, 8)
    assert RewardConfig(rm_workers=0).reward_workers() == 0
    assert RewardConfig(rm_workers=12).reward_workers() == 12
    with pytest.raises(ValueError, match="rm_workers"):
        RewardConfig(rm_workers=-2)


def test_a_terminals_ctrl_c_is_left_to_the_router(reward_file) -> None:
    """Ctrl-C reaches a terminal's whole process group: a worker ignores it (no traceback, no
    lost call); the router decides when its workers stop."""
    reward = made(reward_file, 10.0, workers=1)

    async def run() -> tuple[float, float]:
        first = await reward.score("p", "pid", "l", "stop")
        os.kill(int(first), signal.SIGINT)
        await asyncio.sleep(0.5)
        return first, await reward.score("p", "pid", "l", "stop")

    try:
        first, second = asyncio.run(run())
    finally:
        reward.close()
    assert first == second, "the same worker answered after its Ctrl-C"


def test_a_function_that_fails_on_every_sample_is_broken_after_the_bound_and_a_reward_resets_it(
    reward_file,
) -> None:
    """--rm-max-errors-in-a-row: failures in a row, of any kind, make the function `broken`
    (the rollout loop then stops with that sentence); one reward between them starts anew."""
    reward = made(reward_file, 2.0, workers=0, max_errors_in_a_row=3)

    async def run(texts: list[str]) -> list[str]:
        await reward.score_all("p", [(t, "stop") for t in texts], "l")
        return [reward.broken()]

    assert asyncio.run(run(["boom", "nan", "ok", "boom", "boom"])) == [""]
    [broken] = asyncio.run(run(["nan"]))
    assert broken == (
        "reward function score failed on 3 samples in a row (--rm-max-errors-in-a-row 3), the "
        "last: reward function score returned nan; fix the function (--custom-rm-path; a wrong "
        "or unparsable answer should score 0, not fail), or raise the router's "
        "--rm-max-errors-in-a-row N (0 = never stop; tandem up takes it as it is)"
    )
    never = made(reward_file, 2.0, workers=0, max_errors_in_a_row=0)
    asyncio.run(never.score_all("p", [("boom", "stop")] * 20, "l"))
    assert never.in_a_row == 20 and never.broken() == ""


def test_a_worker_may_take_as_long_as_rm_timeout_s_to_load_a_slow_module(
    tmp_path: Path, monkeypatch
) -> None:
    from services.rollout_router.rollout import reward_workers

    monkeypatch.setattr(reward_workers, "START_TIMEOUT_S", 0.5)
    (tmp_path / "slow.py").write_text(
        "import time\ntime.sleep(1.5)  # a model loaded at import\n\n"
        "def score(text, label, stopped):\n    return 2.0\n"
    )
    path = f"{tmp_path / 'slow.py'}:score"
    patient = made(path, 4.0, workers=1)
    try:
        assert asyncio.run(patient.score("p", "t", "l", "stop")) == 2.0
    finally:
        patient.close()
    with pytest.raises(ValueError) as error:  # the router's start fails
        made(path, 1.0, workers=1)
    assert str(error.value) == (
        f"--custom-rm-path '{path}': could not start in a worker process: not ready within 1s "
        "(loading the function's module: raise --rm-timeout-s, which bounds a worker's start "
        "too when longer than 60 s)"
    )


WHO_IMPORTS = """
import os

with open(os.environ["IMPORTED_BY"], "a") as out:
    out.write(f"{os.getpid()}\\n")


def score(text, label, stopped):
    return 1.0


async def ascore(text, label, stopped):
    return 2.0


def one(text):
    return 1.0
"""


def test_the_router_leaves_the_function_to_its_workers_and_a_bad_one_fails_its_start(
    tmp_path: Path, monkeypatch
) -> None:
    """With workers the router never imports the module (a verifier that loads a model at
    import loads it in its workers only); an async function it imports and runs itself."""
    (tmp_path / "who.py").write_text(WHO_IMPORTS)
    imported = tmp_path / "imported"
    monkeypatch.setenv("IMPORTED_BY", str(imported))
    path = f"{tmp_path / 'who.py'}"
    reward = made(f"{path}:score", 10.0, workers=2)
    try:
        assert reward.fn is None and asyncio.run(reward.score("p", "t", "l", "stop")) == 1.0
        pids = imported.read_text().split()
        assert pids and str(os.getpid()) not in pids
    finally:
        reward.close()
    imported.unlink()
    coroutine = made(f"{path}:ascore", 10.0, workers=2)
    assert coroutine.workers is None and asyncio.run(coroutine.score("p", "t", "l", "x")) == 2.0
    assert str(os.getpid()) in imported.read_text().split()
    with pytest.raises(ValueError) as error:
        made(f"{path}:one", 10.0, workers=2)
    assert str(error.value).startswith(
        f"could not start in a worker process: --custom-rm-path '{path}:one': one(text) cannot "
        "be called as one(response_text, label, stopped)"
    )


def test_a_cancelled_call_keeps_its_worker_and_its_late_answer_goes_to_no_other_call(
    reward_file,
) -> None:
    """A stopped rollout cancels its calls: the worker finishes the call and is used again (a
    new one would load the function's module again), and the next call gets its own value."""
    from services.rollout_router.rollout.reward_workers import RewardWorkers

    async def scenario() -> tuple[Any, ...]:
        pool = RewardWorkers(reward_file, 1, 5.0)
        await pool.start()
        try:
            before = await pool.call("pid", "l", True)
            call = asyncio.create_task(pool.call("slow", "l", True))
            await asyncio.sleep(0.1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            return before, await pool.call("pid", "l", True), await pool.call("abc", "l", True)
        finally:
            pool.close()

    before, after, value = asyncio.run(scenario())
    assert after == before, "the same worker process answers after the cancel"
    assert value == 3.0
