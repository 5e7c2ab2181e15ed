"""One bearer token guards every route that changes a run (router, broker, engine); reads stay open.

The token comes from the environment, `TANDEM_API_TOKEN` (the router also reads its older
`TANDEM_ROUTER_TOKEN` and `--api-token`); `tandem up` generates one per run and passes it to
every child. A service keeps it on `app.state.api_token`; routes that mutate declare
`dependencies=WRITE`. Without a token a service serves loopback only: `check_bind` refuses a
non-loopback address and names the variable to set.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from fastapi import Depends, HTTPException, Request

TOKEN_ENV = "TANDEM_API_TOKEN"
TOKEN_FILE = "api_token"  # where `tandem up` keeps the token it made, in the run folder


def token_from_env(*older: str) -> str:
    """`TANDEM_API_TOKEN`, else the first of `older` variables that is set, else ''."""
    for name in (TOKEN_ENV, *older):
        if value := os.environ.get(name, ""):
            return value
    return ""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_bind(host: str, token: str, service: str) -> None:
    """ValueError when `service` would bind a non-loopback `host` with no token."""
    if not token and not is_loopback(host):
        raise ValueError(
            f"{service} binds {host}, reachable from other machines, but no API token is set: "
            f"set {TOKEN_ENV} (the same value for every service of the run; `tandem up` "
            "generates one), or bind --host 127.0.0.1"
        )


def require_token(request: Request) -> None:
    """FastAPI dependency: 401 unless `Authorization: Bearer <token>` matches (when one is set)."""
    token: str = getattr(request.app.state, "api_token", "")
    if not token:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise HTTPException(
            401,
            f"missing or wrong bearer token (Authorization: Bearer ${TOKEN_ENV}; a `tandem up` "
            f"run keeps its token in RUN_DIR/{TOKEN_FILE})",
        )


WRITE = [Depends(require_token)]


def bearer_headers() -> dict[str, str]:
    """Headers for this service's own calls to a mutating route of another service of the run
    (never for outside servers: environments, reward models)."""
    token = token_from_env()
    return {"Authorization": f"Bearer {token}"} if token else {}
