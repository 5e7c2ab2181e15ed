"""Ask an SGLang-compatible engine which weight version it serves.

SGLang 0.5.23 reports the version only as the `weight_version` field of `GET /model_info` (and
of the deprecated `/get_model_info`); older servers (and Tandem's reference engine) also serve
`GET /get_weight_version`. `weight_version(url)` tries them in that order, moving to the next
route only when one answers 404 (or a body without the field), so a down engine fails fast.
SGLang's JSON holds the version as a string; Tandem holds it as an int (-1: not a number, such
as SGLang's "default" before any update), read here once.

Used by `tandem up` (the run's summary: the versions the engines ended on).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

VERSION_ROUTES = ("/model_info", "/get_model_info", "/get_weight_version")


class VersionUnavailableError(RuntimeError):
    """No route of `VERSION_ROUTES` told the engine's version (or the engine is unreachable)."""


def weight_version(url: str, timeout_s: float = 5.0) -> int:
    """The `weight_version` the engine at `url` reports (-1 when it is not a number)."""
    problems = []
    for route in VERSION_ROUTES:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}{route}", timeout=timeout_s) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            problems.append(f"{route}: HTTP {exc.code}")
            if exc.code in (404, 405):
                continue
            break
        except (OSError, ValueError) as exc:  # unreachable, timed out, not JSON
            problems.append(f"{route}: {exc}")
            break
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None:
            return int(version) if str(version).lstrip("-").isdigit() else -1
        problems.append(f"{route}: no weight_version field")
    raise VersionUnavailableError(f"engine {url}: " + "; ".join(problems))


def versions_or_why(urls: list[str]) -> list[str]:
    """The version each engine serves, or `unreachable: why` in its place (text for the run's
    summary)."""
    versions = []
    for url in urls:
        try:
            versions.append(str(weight_version(url)))
        except VersionUnavailableError as exc:
            versions.append(f"unreachable: {exc}")
    return versions
