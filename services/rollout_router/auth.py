"""Bearer-token check for routes that change state (`--api-token` / `TANDEM_ROUTER_TOKEN`)."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request


def require_token(request: Request) -> None:
    """FastAPI dependency: 401 unless `Authorization: Bearer <token>` matches (when set)."""
    token = request.app.state.config.api_token
    if not token:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise HTTPException(401, "missing or wrong bearer token (see --api-token)")
