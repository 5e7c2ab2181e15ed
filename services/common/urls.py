"""A URL field of a request body: an absolute http(s) URL, else 422 naming the field."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator


def _check_http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError as exc:  # a port that is not a number
        raise ValueError(f"not a URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ValueError("must be an absolute http(s) URL such as http://10.0.0.5:30000")
    if any(c.isspace() for c in value):
        raise ValueError("must not contain spaces")
    return value.rstrip("/")


HttpUrl = Annotated[str, AfterValidator(_check_http_url)]
