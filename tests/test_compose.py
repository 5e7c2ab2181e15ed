"""compose.yaml (GPU), compose.cpu.yaml (CPU), the service definitions both extend
(compose.tandem.yaml), Dockerfile and .dockerignore keep their promises (docs/deploy.md).

No Docker engine is needed: `docker-compose config` and the compose-spec JSON schema validate the
files offline, and the rest reads the YAML (tests/test_containers.py runs the CPU stack on a
real engine; what only a GPU host runs, SGLang's image and the GPU reservations, is checked
here only). Each check is a function returning the problems it
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

from tests.compose_checks import (
    BASE,
    COMPOSE,
    COMPOSE_CPU,
    DUMMY_SECRETS,
    ROOT,
    SECRETS,
    Problems,
    alias_problems,
    batch_problems,
    command,
    compose,
    compose_text,
    data_problems,
    dockerfile_problems,
    dockerignore_problems,
    exposure_problems,
    flag,
    healthcheck_problems,
    image_problems,
    pinned,
    secret_problems,
    trainer_problems,
)

# --- the real files keep the promises ------------------------------------------------------


STACKS = {"gpu": COMPOSE, "cpu": COMPOSE_CPU}


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_every_service_has_a_healthcheck(stack: str) -> None:
    assert healthcheck_problems(compose(STACKS[stack])) == []


def test_images_pinned_and_sglang_matches_the_contract_pin() -> None:
    sglang_pin = pinned((ROOT / "Makefile").read_text(), "sglang")
    assert image_problems(compose(), sglang_pin) == []


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_router_and_trainer_share_the_batch_terms(stack: str) -> None:
    assert batch_problems(compose(STACKS[stack])) == []
    assert alias_problems(compose_text(STACKS[stack])) == []
    assert alias_problems(compose_text(BASE), ("--model",)) == []


def test_trainer_saves_to_a_volume_in_bf16() -> None:
    assert trainer_problems(compose()) == []


def test_router_trains_on_the_data_volume_with_real_lengths() -> None:
    assert data_problems(compose()) == []


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_secrets_are_required_without_defaults(stack: str) -> None:
    text = compose_text(BASE) + compose_text(STACKS[stack])
    assert secret_problems(text, compose(STACKS[stack])) == []


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_ports_bound_to_loopback_and_services_restart(stack: str) -> None:
    assert exposure_problems(compose(STACKS[stack])) == []


def test_both_stacks_run_the_one_definition_of_each_tandem_service() -> None:
    """Every Tandem service of either stack extends compose.tandem.yaml's, and its entrypoint
    (the flags that wire it to the others) is that one's, unchanged."""
    base = yaml.safe_load(compose_text(BASE))["services"]
    for path in STACKS.values():
        raw = yaml.safe_load(compose_text(path))["services"]
        resolved = compose(path)["services"]
        for name in ("valkey", "broker", "router", "trainer"):
            assert raw[name].get("extends", {}).get("file") == BASE.name, (path.name, name)
            assert "entrypoint" not in raw[name], (path.name, name)
            assert resolved[name].get("entrypoint") == base[name].get("entrypoint")
    cpu = yaml.safe_load(compose_text(COMPOSE_CPU))
    engines = [n for n in cpu["services"] if n.startswith("engine-")]
    assert engines and all(
        compose(COMPOSE_CPU)["services"][n]["entrypoint"] == base["engine"]["entrypoint"]
        for n in engines
    )


def test_dockerfile_builds_the_pinned_project_as_non_root() -> None:
    torch_pin = pinned((ROOT / "pyproject.toml").read_text(), "torch")
    assert dockerfile_problems((ROOT / "Dockerfile").read_text(), torch_pin) == []


def test_dockerignore_keeps_the_context_small() -> None:
    assert dockerignore_problems((ROOT / ".dockerignore").read_text()) == []


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_service_flags_parse_with_the_services_own_parsers(stack: str) -> None:
    """Every flag a stack passes exists (a renamed flag fails here, not at `compose up`), each
    configuration passes its own validate(), and the batch terms agree once parsed."""
    from services.common.settings import flat, load
    from services.rollout_router.config import RouterConfig, check_buffer_depth
    from services.trainer.config import TrainerConfig
    from services.weight_broker.config import BrokerConfig

    c = compose(STACKS[stack])
    assert {"engine-0", "engine-1"} <= set(c["services"])
    router_cmd, trainer_cmd, broker_cmd = (
        command(c["services"][name]) for name in ("router", "trainer", "broker")
    )
    assert router_cmd[0] == "router" and trainer_cmd[0] == "trainer" and broker_cmd[0] == "broker"
    router = load(RouterConfig, router_cmd[1:], "router")
    router.validate()
    trainer = load(TrainerConfig, trainer_cmd[1:], "trainer")
    trainer.validate()
    router_flags, trainer_flags = flat(router), flat(trainer)
    assert trainer_flags["save"] == "/checkpoints"
    assert trainer_flags["bf16"] == (stack == "gpu")
    for term in ("rollout_batch_size", "n_samples_per_prompt", "max_staleness", "model"):
        assert router_flags[term] == trainer_flags[term], term
    # The router's depth bound leaves room for the trainer's whole rollout.
    check_buffer_depth(router.buffer_depth_bound(), trainer.run.rollout_batch_size)

    broker = flat(load(BrokerConfig, broker_cmd[1:], "broker"))
    assert broker["transport"] == "disk" and broker["engine_urls"] == router_flags["engine_urls"]


# --- every check can fail ----------------------------------------------------------------


def _drop_healthcheck(c: dict[str, Any]) -> None:
    del c["services"]["trainer"]["healthcheck"]


def _job_restarts(c: dict[str, Any]) -> None:
    c["services"]["init-volumes"]["restart"] = "on-failure"  # no longer one-shot


def _job_not_awaited(c: dict[str, Any]) -> None:
    for svc in c["services"].values():
        (svc.get("depends_on") or {}).pop("init-volumes", None)


def _latest_sglang(c: dict[str, Any]) -> None:
    c["services"]["engine-0"]["image"] = "lmsysorg/sglang:latest"


def _other_sglang(c: dict[str, Any]) -> None:
    c["services"]["engine-1"]["image"] = "lmsysorg/sglang:v0.5.2"


def _untagged(c: dict[str, Any]) -> None:
    c["services"]["valkey"]["image"] = "valkey/valkey"


def _trainer_batch(c: dict[str, Any]) -> None:
    cmd = c["services"]["trainer"]["command"]
    cmd[:] = [a for a in cmd if not a.startswith("--rollout-batch-size")]
    cmd.append("--rollout-batch-size=7")


def _no_save(c: dict[str, Any]) -> None:
    cmd = c["services"]["trainer"]["entrypoint"]
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
    text = compose_text(BASE)
    broken = re.sub(rf"\$\{{{name}:\?[^}}]*\}}", lambda _m: replacement, text)
    assert broken != text
    assert secret_problems(broken + compose_text(), yaml.safe_load(broken)) != []


def test_alias_check_catches_a_copied_value() -> None:
    text = compose_text(BASE)
    # The trainer's alias replaced by a literal of the same value: equal today, free to drift.
    broken = text.replace("- trainer\n      - *model", "- trainer\n      - --model=/models/model")
    assert broken != text
    assert alias_problems(broken, ("--model",)) != []
    text = compose_text(COMPOSE_CPU)
    broken = text.replace(
        "    command:\n      - *rollout-batch-size", "    command:\n      - --rollout-batch-size=64"
    )
    assert broken != text
    assert alias_problems(broken) != []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("ARG TORCH_VERSION=", "ARG TORCH_VERSION=9"),
        ("USER tandem", "USER root"),
        ("RUN pip install --no-deps .\n", "RUN pip install megatron-core==0.16.1\n"),
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
        [
            tool,
            "--builtin-schema",
            "vendor.compose-spec",
            str(COMPOSE),
            str(COMPOSE_CPU),
            str(BASE),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _compose_config(
    env: dict[str, str], quiet: bool = True, path: Path = COMPOSE
) -> subprocess.CompletedProcess[str]:
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
        [tool, "-f", str(path), "config", *(["-q"] if quiet else [])],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
        cwd=ROOT,
    )


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_docker_compose_config_validates(stack: str) -> None:
    result = _compose_config(DUMMY_SECRETS, path=STACKS[stack])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("missing", SECRETS)
def test_docker_compose_refuses_a_missing_secret(missing: str, stack: str) -> None:
    env = {k: v for k, v in DUMMY_SECRETS.items() if k != missing}
    result = _compose_config(env, path=STACKS[stack])
    assert result.returncode != 0
    assert f"set {missing} to a random string" in result.stderr


def test_docker_compose_resolves_one_batch_size_for_both() -> None:
    for path in STACKS.values():
        result = _compose_config({**DUMMY_SECRETS, "ROLLOUT_BATCH_SIZE": "48"}, False, path)
        assert result.returncode == 0, result.stderr
        services = yaml.safe_load(result.stdout)["services"]
        for name in ("router", "trainer"):
            cmd = [str(a) for a in services[name]["command"]]
            assert flag(cmd, "--rollout-batch-size") == "48", (path.name, name)
