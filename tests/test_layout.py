"""The layout is the architecture: a file under `services/<name>/` imports only `proto`, the
shared libraries (`common`, `sample_buffer`, `weight_sync`) and its own folder, never another
service's internals nor the CLI package `tandem`."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[1] / "services"
SHARED = {"common", "sample_buffer", "weight_sync"}


def imported_modules(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def test_no_service_imports_another_services_internals_or_the_cli() -> None:
    violations, files = [], 0
    for path in sorted(SERVICES.rglob("*.py")):
        own = path.relative_to(SERVICES).parts[0]
        files += 1
        for module in imported_modules(path):
            parts = module.split(".")
            foreign = parts[0] == "services" and len(parts) > 1 and parts[1] not in SHARED | {own}
            if parts[0] == "tandem" or foreign:
                violations.append(f"{path.relative_to(SERVICES.parent)} imports {module}")
    assert files > 50  # the walk saw the services
    assert violations == []
