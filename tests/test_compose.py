"""compose.yaml, Dockerfile and .dockerignore keep their promises (docs/deploy.md).

No Docker engine is needed: `docker-compose config` and the compose-spec JSON schema validate the
file offline, and the rest reads the YAML. Each check is a function returning the problems it
finds; it runs on the real files (no problem expected) and on a copy broken on purpose (its
problem expected), so every check is shown able to fail.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
SECRETS = ("TANDEM_WEIGHT_SECRET", "TANDEM_API_TOKEN")
BATCH_FLAGS = ("--rollout-batch-size", "--n-samples-per-prompt", "--max-staleness", "--model")
TANDEM_SERVICES = ("broker", "router", "trainer")
DUMMY_SECRETS = {name: "test-only-not-secret" for name in SECRETS}
# A variable holding a secret, by name (MAX_TOKENS_PER_GPU is not one).
SECRET_NAME = r"\w*(?:SECRET|PASSWORD|API_KEY|_TOKEN(?!S))\w*"

Problems = list[str]


# --- reading -------------------------------------------------------------------------------


def compose_text() -> str:
    return COMPOSE.read_text()


def compose() -> dict[str, Any]:
    return yaml.safe_load(compose_text())


def pinned(text: str, package: str) -> str:
    """`package==X` in a Makefile or pyproject.toml -> X."""
    found = re.search(rf"\b{re.escape(package)}==([0-9][0-9A-Za-z.+-]*)", text)
    assert found, f"no {package}==VERSION pin found"
    return found.group(1)


def resolve(value: str) -> str:
    """Compose interpolation with the file's own defaults (not this shell's variables):
    `${X:-d}` -> d, a required `${X:?m}` -> a stand-in."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        return arg if op in (":-", "-") else DUMMY_SECRETS.get(name, "x")

    return re.sub(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}", one, value)


def command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return [resolve(str(a)) for a in (cmd if isinstance(cmd, list) else cmd.split())]


def flag(cmd: list[str], name: str) -> str | None:
    """The value of `--name=V` or `--name V` (`""` for a bare switch), None when absent."""
    for i, arg in enumerate(cmd):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name:
            nxt = cmd[i + 1] if i + 1 < len(cmd) else ""
            return "" if nxt.startswith("--") else nxt
    return None


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> mode ("ro" or "rw") of each volume (short syntax)."""
    out = {}
    for spec in service.get("volumes", []):
        parts = spec.split(":")
        out[parts[1]] = parts[2] if len(parts) > 2 else "rw"
    return out


# --- the checks ------------------------------------------------------------------------------


def one_shot_jobs(c: dict[str, Any]) -> set[str]:
    """Services that run once and exit (restart "no"), which others wait for to complete."""
    awaited = {
        dep
        for svc in c["services"].values()
        for dep, cond in (svc.get("depends_on") or {}).items()
        if isinstance(cond, dict) and cond.get("condition") == "service_completed_successfully"
    }
    return {n for n in awaited if str(c["services"][n].get("restart", "no")) == "no"}


def healthcheck_problems(c: dict[str, Any]) -> Problems:
    """Every long-running service has one; a one-shot job exits before any check could run."""
    problems = []
    jobs = one_shot_jobs(c)
    for name, svc in c["services"].items():
        hc = svc.get("healthcheck")
        if name in jobs:
            continue
        if not hc or hc.get("disable") or hc.get("test") in ("NONE", ["NONE"], None):
            problems.append(f"{name}: no healthcheck")
    return problems


def image_problems(c: dict[str, Any], sglang_pin: str) -> Problems:
    problems = []
    sglang_images = []
    for name, svc in c["services"].items():
        image = svc.get("image", "")
        if not image:
            problems.append(f"{name}: no image name")
            continue
        reference = image.split("@", 1)[0]
        last = reference.rsplit("/", 1)[-1]
        tag = last.split(":", 1)[1] if ":" in last else ""
        repo = reference.removesuffix(":" + tag) if tag else reference
        if "@sha256:" not in image and (not tag or tag == "latest"):
            problems.append(f"{name}: image {image!r} is not pinned to a tag")
        if "sglang" in repo:
            sglang_images.append((name, tag))
    if not sglang_images:
        problems.append("no SGLang service")
    for name, tag in sglang_images:
        if not re.fullmatch(rf"v?{re.escape(sglang_pin)}(-[\w.]+)?", tag):
            problems.append(f"{name}: SGLang image tag {tag!r} != the pin sglang=={sglang_pin}")
    return problems


def batch_problems(c: dict[str, Any]) -> Problems:
    """Router and trainer state the same batch terms (and the same model)."""
    router, trainer = command(c["services"]["router"]), command(c["services"]["trainer"])
    problems = []
    for name in BATCH_FLAGS:
        r, t = flag(router, name), flag(trainer, name)
        if r is None or t is None:
            problems.append(f"{name}: router {r!r}, trainer {t!r} (both must set it)")
        elif r != t:
            problems.append(f"{name}: router {r!r} != trainer {t!r}")
    return problems


def alias_problems(text: str) -> Problems:
    """Each batch term is one YAML node shared (by an alias) by router and trainer."""
    root = yaml.compose(text)
    assert isinstance(root, yaml.MappingNode)
    services = next(v for k, v in root.value if k.value == "services")

    def nodes(service: str) -> dict[str, yaml.Node]:
        svc = next(v for k, v in services.value if k.value == service)
        cmd = next(v for k, v in svc.value if k.value == "command")
        return {n.value.split("=", 1)[0]: n for n in cmd.value if isinstance(n, yaml.ScalarNode)}

    router, trainer = nodes("router"), nodes("trainer")
    return [
        f"{name}: router and trainer do not share one anchored value"
        for name in BATCH_FLAGS
        if router.get(name) is None or router.get(name) is not trainer.get(name)
    ]


def trainer_problems(c: dict[str, Any]) -> Problems:
    trainer = c["services"]["trainer"]
    cmd = command(trainer)
    problems = []
    save = flag(cmd, "--save")
    if not save:
        problems.append("trainer: no --save")
    elif mounts(trainer).get(save) != "rw":
        problems.append(f"trainer: --save {save} is not a writable volume")
    if int(flag(cmd, "--save-interval") or 0) < 1:
        problems.append("trainer: no --save-interval >= 1")
    if flag(cmd, "--bf16") != "":
        problems.append("trainer: no --bf16")
    return problems


def data_problems(c: dict[str, Any]) -> Problems:
    router = c["services"]["router"]
    cmd = command(router)
    problems = []
    data = flag(cmd, "--prompt-data") or ""
    if not data or not any(data.startswith(m + "/") for m in mounts(router)):
        problems.append(f"router: --prompt-data {data!r} is not on a mounted volume")
    if int(flag(cmd, "--rollout-max-response-len") or 0) < 256:
        problems.append("router: --rollout-max-response-len below 256 (the toy task's length?)")
    return problems


def secret_problems(text: str, c: dict[str, Any]) -> Problems:
    problems = [
        f"{m.group(1)} has a default value ({m.group(0)}...)"
        for m in re.finditer(rf"\$\{{({SECRET_NAME})(:?[-=+]|\}})", text)
    ]
    for name in SECRETS:
        if not re.search(rf"\$\{{{name}:\?[^}}]+\}}", text):
            problems.append(f"{name} is not required (${{{name}:?message}})")
    for svc_name, svc in c["services"].items():
        env = svc.get("environment", {})
        for key, value in env.items() if isinstance(env, dict) else []:
            if re.fullmatch(SECRET_NAME, key) and not re.fullmatch(
                rf"\$\{{{key}:\?[^}}]+\}}", str(value)
            ):
                problems.append(f"{svc_name}: {key} is not ${{{key}:?message}}")
    return problems


def exposure_problems(c: dict[str, Any]) -> Problems:
    problems = []
    for name, svc in c["services"].items():
        for port in svc.get("ports", []):
            if not str(port).startswith("127.0.0.1:"):
                problems.append(f"{name}: port {port} is not bound to 127.0.0.1")
        if name in TANDEM_SERVICES and not str(svc.get("restart", "")).startswith("on-failure"):
            problems.append(f"{name}: restart is not on-failure")
    return problems


def dockerfile_problems(text: str, torch_pin: str) -> Problems:
    problems = []
    arg = re.search(r"^ARG TORCH_VERSION=(\S+)", text, re.M)
    if not arg or arg.group(1) != torch_pin:
        problems.append(
            f"Dockerfile TORCH_VERSION {arg and arg.group(1)!r} != pyproject {torch_pin}"
        )
    if not re.search(r"pip install (--\S+ )*\.(\s|$)", text):
        problems.append("Dockerfile does not `pip install .` the project")
    if "megatron-core" in text:
        problems.append("Dockerfile repeats pyproject.toml's dependency list")
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    if not users or users[-1] in ("root", "0", "0:0"):
        problems.append("Dockerfile runs as root")
    return problems


def dockerignore_problems(text: str) -> Problems:
    entries = {line.strip().rstrip("/") for line in text.splitlines()}
    wanted = (".venv", ".git", "runs", "checkpoints", "data", "models", ".env", ".whl", ".gl")
    return [f".dockerignore does not exclude {w}" for w in wanted if w not in entries]


# --- the real files keep the promises ------------------------------------------------------


def test_every_service_has_a_healthcheck() -> None:
    assert healthcheck_problems(compose()) == []


def test_images_pinned_and_sglang_matches_the_contract_pin() -> None:
    sglang_pin = pinned((ROOT / "Makefile").read_text(), "sglang")
    assert image_problems(compose(), sglang_pin) == []


def test_router_and_trainer_share_the_batch_terms() -> None:
    assert batch_problems(compose()) == []
    assert alias_problems(compose_text()) == []


def test_trainer_saves_to_a_volume_in_bf16() -> None:
    assert trainer_problems(compose()) == []


def test_router_trains_on_the_data_volume_with_real_lengths() -> None:
    assert data_problems(compose()) == []


def test_secrets_are_required_without_defaults() -> None:
    assert secret_problems(compose_text(), compose()) == []


def test_ports_bound_to_loopback_and_services_restart() -> None:
    assert exposure_problems(compose()) == []


def test_dockerfile_builds_the_pinned_project_as_non_root() -> None:
    torch_pin = pinned((ROOT / "pyproject.toml").read_text(), "torch")
    assert dockerfile_problems((ROOT / "Dockerfile").read_text(), torch_pin) == []


def test_dockerignore_keeps_the_context_small() -> None:
    assert dockerignore_problems((ROOT / ".dockerignore").read_text()) == []


def test_service_flags_parse_with_the_services_own_parsers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flag compose passes exists (a renamed flag fails here, not at `compose up`), and
    the batch terms agree once parsed."""
    from services.common.flags import config_from_args
    from services.rollout_router.__main__ import build_parser as router_parser
    from services.rollout_router.config import RouterConfig, check_buffer_depth
    from services.trainer.__main__ import build_parser as trainer_parser
    from services.trainer.config import TrainerConfig
    from services.weight_broker import __main__ as broker_main

    c = compose()
    router_cmd, trainer_cmd, broker_cmd = (
        command(c["services"][name]) for name in ("router", "trainer", "broker")
    )
    assert router_cmd[0] == "router" and trainer_cmd[0] == "trainer" and broker_cmd[0] == "broker"
    router = config_from_args(RouterConfig, router_parser().parse_args(router_cmd[1:]))
    router.workers.validate()
    router.sampling.validate()
    trainer = config_from_args(TrainerConfig, trainer_parser().parse_args(trainer_cmd[1:]))
    trainer.validate()
    assert trainer.bf16 and trainer.save == "/checkpoints"
    for term in ("rollout_batch_size", "n_samples_per_prompt", "max_staleness"):
        assert getattr(router.rollout, term) == getattr(trainer, term), term
    # The router's depth bound leaves room for the trainer's whole rollout.
    check_buffer_depth(router.rollout.buffer_depth_bound(), trainer.rollout_batch_size)

    class ParsedError(Exception):
        pass

    def stop(config: Any) -> str:
        raise ParsedError(config)

    monkeypatch.setattr(broker_main, "agree_contract", stop)
    with pytest.raises(ParsedError) as parsed:
        broker_main.main(broker_cmd[1:])
    broker = parsed.value.args[0]
    assert broker.transport == "disk" and broker.engine_urls == router.workers.engine_urls


# --- every check can fail ----------------------------------------------------------------


def _drop_healthcheck(c: dict[str, Any]) -> None:
    del c["services"]["trainer"]["healthcheck"]


def _job_restarts(c: dict[str, Any]) -> None:
    c["services"]["init-volumes"]["restart"] = "on-failure"  # no longer one-shot


def _job_not_awaited(c: dict[str, Any]) -> None:
    for svc in c["services"].values():
        (svc.get("depends_on") or {}).pop("init-volumes", None)


def _latest_sglang(c: dict[str, Any]) -> None:
    c["services"]["sglang-0"]["image"] = "lmsysorg/sglang:latest"


def _other_sglang(c: dict[str, Any]) -> None:
    c["services"]["sglang-1"]["image"] = "lmsysorg/sglang:v0.5.2"


def _untagged(c: dict[str, Any]) -> None:
    c["services"]["valkey"]["image"] = "valkey/valkey"


def _trainer_batch(c: dict[str, Any]) -> None:
    cmd = c["services"]["trainer"]["command"]
    cmd[:] = [a for a in cmd if not a.startswith("--rollout-batch-size")]
    cmd.append("--rollout-batch-size=7")


def _no_save(c: dict[str, Any]) -> None:
    cmd = c["services"]["trainer"]["command"]
    cmd[:] = [a for a in cmd if not a.startswith("--save=")]


def _save_not_mounted(c: dict[str, Any]) -> None:
    trainer = c["services"]["trainer"]
    trainer["volumes"] = [v for v in trainer["volumes"] if ":/checkpoints" not in v]


def _no_bf16(c: dict[str, Any]) -> None:
    c["services"]["trainer"]["command"].remove("--bf16")


def _toy_length(c: dict[str, Any]) -> None:
    cmd = c["services"]["router"]["command"]
    cmd[:] = [a for a in cmd if not a.startswith("--rollout-max-response-len")] + [
        "--rollout-max-response-len=4"
    ]


def _open_port(c: dict[str, Any]) -> None:
    c["services"]["router"]["ports"] = ["8200:8200"]


def _no_restart(c: dict[str, Any]) -> None:
    c["services"]["broker"]["restart"] = "no"


def _data_not_mounted(c: dict[str, Any]) -> None:
    router = c["services"]["router"]
    router["volumes"] = [v for v in router["volumes"] if ":/data" not in v]


COMPOSE_BREAKAGES: dict[str, tuple[Callable[[dict[str, Any]], None], Callable[..., Problems]]] = {
    "no healthcheck": (_drop_healthcheck, healthcheck_problems),
    "restarting job without healthcheck": (_job_restarts, healthcheck_problems),
    "job nobody waits for": (_job_not_awaited, healthcheck_problems),
    "latest sglang": (_latest_sglang, lambda c: image_problems(c, "0.5.23")),
    "other sglang": (_other_sglang, lambda c: image_problems(c, "0.5.23")),
    "untagged image": (_untagged, lambda c: image_problems(c, "0.5.23")),
    "trainer batch differs": (_trainer_batch, batch_problems),
    "no --save": (_no_save, trainer_problems),
    "--save not on a volume": (_save_not_mounted, trainer_problems),
    "no --bf16": (_no_bf16, trainer_problems),
    "toy response length": (_toy_length, data_problems),
    "public port": (_open_port, exposure_problems),
    "no restart": (_no_restart, exposure_problems),
    "data not mounted": (_data_not_mounted, data_problems),
}


@pytest.mark.parametrize("breakage", sorted(COMPOSE_BREAKAGES))
def test_compose_checks_catch_a_broken_file(breakage: str) -> None:
    c = compose()
    assert COMPOSE_BREAKAGES[breakage][1](c) == []
    broken = copy.deepcopy(c)
    COMPOSE_BREAKAGES[breakage][0](broken)
    assert COMPOSE_BREAKAGES[breakage][1](broken) != []


@pytest.mark.parametrize(
    "replacement",
    ["${TANDEM_WEIGHT_SECRET:-change-me}", "${TANDEM_API_TOKEN}", "${TANDEM_API_TOKEN-x}"],
)
def test_secret_check_catches_a_default(replacement: str) -> None:
    name = re.match(r"\$\{(\w+)", replacement).group(1)  # type: ignore[union-attr]
    text = compose_text()
    broken = re.sub(rf"\$\{{{name}:\?[^}}]*\}}", lambda _m: replacement, text)
    assert broken != text
    assert secret_problems(broken, yaml.safe_load(broken)) != []


def test_alias_check_catches_a_copied_value() -> None:
    text = compose_text()
    # The trainer's alias replaced by a literal of the same value: equal today, free to drift.
    broken = text.replace("- trainer\n      - *model", "- trainer\n      - --model=/models/model")
    assert broken != text
    assert alias_problems(broken) != []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("ARG TORCH_VERSION=", "ARG TORCH_VERSION=9"),
        ("USER tandem", "USER root"),
        ("RUN pip install . ", "RUN pip install megatron-core==0.16.1 "),
    ],
)
def test_dockerfile_check_catches_a_drift(old: str, new: str) -> None:
    text = (ROOT / "Dockerfile").read_text()
    torch_pin = pinned((ROOT / "pyproject.toml").read_text(), "torch")
    assert old in text
    assert dockerfile_problems(text.replace(old, new), torch_pin) != []


def test_dockerignore_check_catches_a_missing_venv() -> None:
    text = (ROOT / ".dockerignore").read_text()
    assert dockerignore_problems(re.sub(r"^\.venv$", "", text, flags=re.M)) != []


# --- offline validators ----------------------------------------------------------------------


def _tool(name: str) -> str | None:
    """A console script on PATH or beside this interpreter (the venv's bin/)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def test_compose_spec_schema() -> None:
    tool = _tool("check-jsonschema")
    assert tool, "check-jsonschema is a dev dependency (pip install -e '.[dev]')"
    result = subprocess.run(
        [tool, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _compose_config(env: dict[str, str], quiet: bool = True) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip(
            "docker-compose is not on PATH (Debian: apt-get install docker-compose). Not a dev "
            "dependency: Compose v1 on PyPI (1.29.2, the last) needs PyYAML<6 and jsonschema<4, "
            "which check-jsonschema's jsonschema>=4 excludes. The compose-spec schema test runs "
            "regardless"
        )
    base = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return subprocess.run(
        [tool, "-f", str(COMPOSE), "config", *(["-q"] if quiet else [])],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
        cwd=ROOT,
    )


def test_docker_compose_config_validates() -> None:
    result = _compose_config(DUMMY_SECRETS)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("missing", SECRETS)
def test_docker_compose_refuses_a_missing_secret(missing: str) -> None:
    env = {k: v for k, v in DUMMY_SECRETS.items() if k != missing}
    result = _compose_config(env)
    assert result.returncode != 0
    assert f"set {missing} to a random string" in result.stderr


def test_docker_compose_resolves_one_batch_size_for_both() -> None:
    result = _compose_config({**DUMMY_SECRETS, "ROLLOUT_BATCH_SIZE": "48"}, quiet=False)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("router", "trainer"):
        assert flag([str(a) for a in services[name]["command"]], "--rollout-batch-size") == "48"
