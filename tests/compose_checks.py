"""The checks of compose.yaml (with the services it extends from compose.tandem.yaml),
compose.cpu.yaml, Dockerfile and .dockerignore that tests/test_compose.py runs: each returns the
problems it finds in the (parsed) files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
COMPOSE_CPU = ROOT / "compose.cpu.yaml"
BASE = ROOT / "compose.tandem.yaml"
SECRETS = ("TANDEM_WEIGHT_SECRET", "TANDEM_API_TOKEN", "TANDEM_REDIS_PASSWORD")
BATCH_FLAGS = ("--rollout-batch-size", "--n-samples-per-prompt", "--max-staleness", "--model")
TANDEM_SERVICES = ("broker", "router", "trainer")
DUMMY_SECRETS = {name: "test-only-not-secret" for name in SECRETS}
# A variable holding a secret, by name (MAX_TOKENS_PER_GPU is not one).
SECRET_NAME = r"\w*(?:SECRET|PASSWORD|API_KEY|_TOKEN(?!S))\w*"

Problems = list[str]


# --- reading -------------------------------------------------------------------------------


def compose_text(path: Path = COMPOSE) -> str:
    return path.read_text()


def compose(path: Path = COMPOSE) -> dict[str, Any]:
    """The file with each service's `extends` resolved as Compose does (the extended service,
    then this one's keys: mappings merged, volumes and ports by target, others replaced)."""
    c = yaml.safe_load(compose_text(path))
    for name, svc in c["services"].items():
        if ext := svc.pop("extends", None):
            other = compose(path.parent / ext["file"])["services"][ext["service"]]
            c["services"][name] = merged(other, svc)
    return dict(c)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in base.items() if k not in ("depends_on", "links", "volumes_from")}
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        elif key in ("volumes", "ports") and isinstance(out.get(key), list):
            target = {str(v).split(":")[1 if key == "volumes" else -1]: v for v in out[key]}
            target.update({str(v).split(":")[1 if key == "volumes" else -1]: v for v in value})
            out[key] = list(target.values())
        else:
            out[key] = value
    return out


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
    """The service's command line: its entrypoint's from `tandem` on (without it, so a Tandem
    service's starts with its subcommand), then its command (a stack's own flags)."""
    entry, cmd = service.get("entrypoint") or [], service.get("command") or []
    entry = entry if isinstance(entry, list) else entry.split()
    cmd = cmd if isinstance(cmd, list) else cmd.split()
    if "tandem" in entry:
        entry = entry[entry.index("tandem") + 1 :]
    return [resolve(str(a)) for a in (*entry, *cmd)]


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


def alias_problems(text: str, terms: tuple[str, ...] = BATCH_FLAGS[:3]) -> Problems:
    """Each batch term is one YAML node shared (by an alias) by router and trainer (in their
    command, or in their entrypoint for compose.tandem.yaml's --model)."""
    root = yaml.compose(text)
    assert isinstance(root, yaml.MappingNode)
    services = next(v for k, v in root.value if k.value == "services")

    def nodes(service: str) -> dict[str, yaml.Node]:
        svc = next(v for k, v in services.value if k.value == service)
        seqs = [v for k, v in svc.value if k.value in ("command", "entrypoint")]
        return {
            n.value.split("=", 1)[0]: n
            for seq in seqs
            if isinstance(seq, yaml.SequenceNode)
            for n in seq.value
            if isinstance(n, yaml.ScalarNode)
        }

    router, trainer = nodes("router"), nodes("trainer")
    return [
        f"{name}: router and trainer do not share one anchored value"
        for name in terms
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
