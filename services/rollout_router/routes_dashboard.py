"""The operator's dashboard: a static page at `/` and the two read-only routes it polls beside
`GET /workers` and `GET /rollout/status`.

`GET /rollout/metrics?after=ID` pages through the run's metrics stream (the `MetricsRecord`s
the trainer and the router publish to Redis), oldest first, at most `limit` records a call;
the page passes the last `id` it has to get only newer ones. `GET /rollout/samples` answers
the newest groups the rollout loop put, as text and rewards (rollout/recent.py). The page is plain
HTML and JavaScript under `static/` with no build step and nothing fetched from elsewhere, so
it works offline; its pause and resume buttons call the rollout control routes with the token
the user pastes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse
from redis.exceptions import RedisError

from services.sample_buffer import AsyncSampleBuffer

router = APIRouter()

STATIC = Path(__file__).parent / "static"
PAGES = {"index.html": "text/html", "dashboard.js": "text/javascript"}
STREAM_ID = r"^\d{1,15}(-\d{1,15})?$"  # a Redis stream id (ms-seq) or "0"


@router.get("/", include_in_schema=False)
async def dashboard() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type=PAGES["index.html"])


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> FileResponse:
    if name not in PAGES:
        raise HTTPException(404, f"no static file {name!r}")
    return FileResponse(STATIC / name, media_type=PAGES[name])


def finite(values: dict[str, float]) -> dict[str, float | None]:
    """JSON has no NaN or infinity: those values become null."""
    return {k: v if math.isfinite(v) else None for k, v in values.items()}


async def metrics_page(
    buffer: AsyncSampleBuffer, after: str, limit: int, keys: str
) -> dict[str, Any]:
    """A page of records; with `keys` (comma-separated names) only those values, and only the
    records that have one (the dashboard asks for the few it draws)."""
    records = await buffer.read_metrics(after, count=limit)
    wanted = set(keys.split(",")) if keys else None
    page = []
    for entry_id, r in records:
        values = r.values if wanted is None else {k: r.values[k] for k in wanted & r.values.keys()}
        if values:
            record = {"id": entry_id, "source": r.source, "step": r.step, "time": r.time}
            page.append({**record, "values": finite(values)})
    return {
        "records": page,
        "last_id": records[-1][0] if records else after,
        "more": len(records) == limit,
    }


@router.get("/rollout/metrics", tags=["rollout"])
async def rollout_metrics(
    request: Request,
    after: Annotated[str, Query(pattern=STREAM_ID)] = "0",
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
    keys: Annotated[str, Query(max_length=2000)] = "",
) -> dict[str, Any]:
    """The run's metrics records after stream id `after` (exclusive), oldest first, at most
    `limit` read; `more` is true when there may be newer ones (call again with
    `after=last_id`). `keys` (comma-separated metric names) keeps only those values."""
    buffer = request.app.state.buffer
    try:
        return await metrics_page(buffer, after, limit, keys)
    except RedisError as exc:
        raise HTTPException(503, f"the metrics stream is unavailable: Redis: {exc}") from exc


@router.get("/rollout/samples", tags=["rollout"])
async def rollout_samples(
    request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 8
) -> dict[str, Any]:
    """The newest groups the rollout loop put (prompt, label, each response's text and reward),
    newest first; empty without a rollout loop or before its first put."""
    control = request.app.state.control
    groups = control.loop.recent.newest(limit) if control is not None else []
    return {"groups": groups}
