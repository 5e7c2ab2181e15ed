"""The CPU stack (compose.cpu.yaml) built and run on a real Docker engine, faults included.

Marked `containers`: `make test` leaves it out, `make test-containers` (and .ci/run) runs it.
On a root machine with apt and no Docker it installs Debian's docker.io, docker-compose and
debootstrap, starts dockerd and stops it after, builds stand-ins for the images no registry
gives (tests/containers/stand_ins.sh) and the project's image, then runs one stack per test,
each under its own compose project, reached only on its 127.0.0.1 ports, and removed after
(containers, network, volumes). Images stay as the build cache. In CI (CI set) a machine where
Docker cannot be set up fails; elsewhere it skips.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import redis

from tests.containers.docker_host import (
    PHASES,
    Dockerd,
    HostNotReadyError,
    build_images,
    install_tools,
    phase,
    phases_said,
    say,
)
from tests.containers.stack import Stack

pytestmark = pytest.mark.containers

START_S = 300.0  # images built: a stack's services healthy and training (2 loaded cores)
GOAL_S = 600.0  # the toy task to 90% held-out accuracy, start-up included
started = time.monotonic()


@pytest.fixture(scope="module")
def docker() -> Iterator[dict[str, float]]:
    daemon = Dockerd()
    try:
        install_tools()
        with phase("dockerd start"):
            daemon.start()
        took = build_images()
    except HostNotReadyError as exc:
        daemon.stop()
        if os.environ.get("CI"):
            pytest.fail(f"Docker cannot be set up on this CI machine: {exc}")
        pytest.skip(f"no Docker here: {exc}")
    try:
        yield took
    finally:
        with phase("dockerd stop"):
            daemon.stop()
        say(phases_said(time.monotonic() - started))


@contextlib.contextmanager
def running(name: str, **settings: str) -> Iterator[Stack]:
    """A stack of its own compose project, removed after (its logs shown when the test fails)."""
    stack = Stack(name, **settings)
    start = time.monotonic()
    try:
        yield stack
    except BaseException:
        say(
            f"{stack.project} failed; its logs:\n{stack.compose('logs', '--no-color', '--tail', '60', timeout_s=120, check=False)}"
        )
        raise
    finally:
        left = stack.remove()
        PHASES[f"stack {name} (up to removed)"] = time.monotonic() - start
        say(f"stack {name}: {PHASES[f'stack {name} (up to removed)']:.0f} s")
        assert not left, f"left behind: {left}"


def no_group_trained_twice(stack: Stack) -> int:
    """The final lineage (version -> its groups) covers versions 1..N once each, no group in two
    of them. Returns N."""
    lineage = stack.lineage()
    assert lineage, "no lineage written"
    final = max(lineage)
    assert sorted(lineage) == list(range(1, final + 1)), sorted(lineage)
    groups = [g for step in sorted(lineage) for g in lineage[step]]
    assert len(groups) == len(set(groups)), "a group trained in two versions"
    return final


def test_the_cpu_stack_trains_the_toy_task_to_its_goal_with_one_command(
    docker: dict[str, float],
) -> None:
    with running("goal") as stack:
        start = time.monotonic()
        out = stack.compose("up", "--exit-code-from", "trainer", timeout_s=GOAL_S)
        say(f"goal run: trainer exited 0 after {time.monotonic() - start:.0f} s of `up`")
        assert "stopping the trainer" in out and ">= STOP_ACCURACY 0.9" in out, out[-4000:]
        assert stack.password not in out, "a service printed the Redis password"
        stack.compose("up", "-d", "valkey", timeout_s=120)
        best = max(r.get("eval/accuracy", 0.0) for r in stack.metrics())
        say(f"goal run: best held-out accuracy {best:.2f}")
        assert best >= 0.9
        stack.ledger()
        no_group_trained_twice(stack)
        listing = stack.compose(
            "run",
            "--rm",
            "--no-deps",
            "--entrypoint",
            "ls",
            "trainer",
            "/checkpoints/trained_model",
            timeout_s=120,
        )
        assert "config.json" in listing and "model.safetensors" in listing, listing


@pytest.fixture(scope="class")
def fault_stack(docker: dict[str, float]) -> Iterator[Stack]:
    """One stack for the exposure checks, then an engine's crash, a trainer's crash and `down`/
    `up`, in that order: checkpoints every 5 steps, no goal, a high step bound, so the run goes
    on until the last test stops it."""
    with running("faults", STOP_ACCURACY="0", MAX_STEPS="300", SAVE_INTERVAL="5") as stack:
        stack.compose("up", "-d", timeout_s=START_S)
        yield stack


def refused(url: str, method: str = "POST", body: bytes = b"{}") -> int:
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def valkey_asks_for_its_password(stack: Stack) -> None:
    """Through Valkey's published port: no password or a wrong one is refused, the stack's is
    taken; `tandem ledger` and a broker given a wrong one say so naming TANDEM_REDIS_PASSWORD,
    printing no password; no service has printed the stack's."""
    wrong = secrets.token_hex(16)
    for password in ("", wrong):
        with pytest.raises(redis.AuthenticationError):
            stack.redis(password).ping()
    assert stack.redis().ping()
    ledger = stack.tandem("ledger", password="")
    said = ledger.stdout + ledger.stderr
    assert ledger.returncode == 2 and "TANDEM_REDIS_PASSWORD" in said, said[-3000:]
    assert "Traceback" not in said and stack.password not in said
    broker = stack.compose(
        "run",
        "--rm",
        "--no-deps",
        "-e",
        f"TANDEM_REDIS_PASSWORD={wrong}",
        "broker",
        timeout_s=120,
        check=False,
    )
    assert "TANDEM_REDIS_PASSWORD is set to another password" in broker, broker[-3000:]
    assert wrong not in broker and stack.password not in broker
    logs = stack.compose("logs", "--no-color", timeout_s=120, check=False)
    assert stack.password not in logs, "a service printed the Redis password"


def readmissions(stack: Stack) -> list[int]:
    """Weight versions at which the router admitted engine-0 again (from its log)."""
    mark = "re-admitted http://engine-0:30000 at weight version "
    return [
        int(line.split(mark)[1].split()[0])
        for line in stack.logs("router").splitlines()
        if mark in line
    ]


def resumed_from(stack: Stack) -> list[int]:
    """The iterations the trainer's containers resumed from (its log)."""
    log = stack.logs("trainer").splitlines()
    return [int(line.split()[-2]) for line in log if "resumed from iteration" in line]


class TestOneRunThroughItsFaults:
    """Exposure, an engine's crash, a trainer's crash, then down and up, in one run (its
    ledger balanced after each); a clean stop ends it."""

    def test_ports_are_published_on_loopback_and_services_refuse_requests_without_the_secrets(
        self, fault_stack: Stack
    ) -> None:
        stack = fault_stack
        for service in ("valkey", "engine-0", "engine-1", "broker", "router"):
            bindings = stack.inspect(service)["HostConfig"]["PortBindings"] or {}
            hosts = {b["HostIp"] for spec in bindings.values() for b in spec}
            assert hosts == {"127.0.0.1"}, (service, bindings)
        base = "http://127.0.0.1:{}"
        for port, route in (
            ("ROUTER_PORT", "/rollout/stop"),
            ("BROKER_PORT", "/engines"),
            ("ENGINE_0_PORT", "/update_weights_from_disk"),
            ("ENGINE_1_PORT", "/pause_generation"),
        ):
            code = refused(base.format(stack.port(port)) + route)
            assert code in (401, 403), (port, route, code)
        blank = stack.compose(
            "run",
            "--rm",
            "--no-deps",
            "-e",
            "TANDEM_WEIGHT_SECRET=",
            "broker",
            timeout_s=120,
            check=False,
        )
        assert "TANDEM_WEIGHT_SECRET" in blank, blank[-3000:]
        valkey_asks_for_its_password(stack)

    def test_an_engine_killed_mid_run_comes_back_at_the_current_version(
        self, fault_stack: Stack
    ) -> None:
        """The restarted engine is admitted again and a few versions more are trained."""
        stack = fault_stack
        at_kill = stack.wait_for("trainer at version 3", stack.at_version(3), START_S) - 1
        restarts = stack.kill_9("engine-0")
        stack.wait_for("engine-0 restarted", stack.restarted("engine-0", restarts), 120)
        readmitted = stack.wait_for(
            "the router admits engine-0 again", lambda: readmissions(stack), START_S
        )
        at_readmission = stack.version()
        say(
            f"engine-0 killed at version {at_kill}, admitted again at weight version "
            f"{readmitted[0]} (the trainer's was {at_readmission} just after)"
        )
        assert readmitted[0] >= at_kill
        stack.wait_for("3 versions more", stack.at_version(at_readmission + 3), START_S)
        stack.ledger()
        no_group_trained_twice(stack)

    def test_a_trainer_killed_mid_run_resumes_from_its_checkpoint(self, fault_stack: Stack) -> None:
        stack = fault_stack
        stack.wait_for("trainer at version 7", stack.at_version(7), START_S)
        restarts = stack.kill_9("trainer")
        at_kill = stack.version()  # (the trainer is gone: its version stays)
        stack.wait_for("trainer restarted", stack.restarted("trainer", restarts), 120)
        stack.wait_for("2 versions past the kill", stack.at_version(at_kill + 2), START_S)
        resumed = resumed_from(stack)
        say(f"trainer killed at version {at_kill}, resumed from iteration(s) {resumed}")
        assert resumed and 0 < resumed[-1] <= at_kill, stack.logs("trainer")[-4000:]
        stack.ledger()
        no_group_trained_twice(stack)

    def test_down_and_up_again_continues_the_run(self, fault_stack: Stack) -> None:
        """`down` (volumes kept) stops the trainer cleanly: it checkpoints the version it stopped
        at, and `up` goes on from there, with the prompt cursor where it was; a clean stop then
        ends the run (exit 0)."""
        stack = fault_stack
        stack.compose("down", "--timeout", "120", timeout_s=300)
        stack.compose("up", "-d", "valkey", timeout_s=120)  # (the run's state, read at rest)
        version = stack.wait_for("Valkey answers again", stack.at_version(1), 120) - 1
        drawn = stack.counter("prompts_drawn")
        say(f"down at version {version}, {drawn} prompts drawn")
        stack.compose("up", "-d", timeout_s=START_S)
        stack.wait_for("3 versions past the restart", stack.at_version(version + 3), START_S)
        stack.compose("stop", "--timeout", "120", "trainer", timeout_s=300)
        assert stack.wait_exit("trainer", 60) == 0
        resumed, drawn_after = resumed_from(stack), stack.counter("prompts_drawn")
        say(f"up again: resumed from iteration {resumed}; {drawn_after} prompts drawn at the stop")
        assert resumed == [version], stack.logs("trainer")[-4000:]
        assert drawn_after > drawn
        stack.ledger()
        assert no_group_trained_twice(stack) >= version + 3
