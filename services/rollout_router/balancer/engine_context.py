"""The engines' context length against the rollout's response bound.

Knows: each engine's reported context length (`context_length` of `GET /server_info`, as SGLang
and Tandem's engine report it; 0 when an engine does not say) and the response bound in use.
Does not know: why an engine was started with that context (its `--context-length`, or its KV
budget lowering it).

An engine whose context cannot hold `--rollout-max-response-len` tokens and one prompt token
would cut or refuse every long sample, so it gets no traffic: `ContextGate` is the pool's
admission check (`WorkerPool.vet`), run before an engine is admitted at run time and, once the
response bound is known, over the engines admitted at start; the health checks run it again on
each refused engine, so one restarted at its URL with a larger context is admitted. A start where no engine fits fails
naming them; a `PATCH /rollout/config` whose response bound the smallest admitted context
cannot hold is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp

from services.rollout_router.balancer.workers import WorkerPool

log = logging.getLogger("tandem.router.workers")


def context_problem(url: str, context: int, length: int) -> str:
    """Why the engine at `url` with `context` positions (0: unknown) cannot serve responses
    up to `length` tokens; "" when it can."""
    if not context or context > length:
        return ""
    return (
        f"engine {url} has a context length of {context} tokens (its /server_info), which "
        f"cannot hold a response of --rollout-max-response-len {length} and a prompt: start "
        f"the engine with --context-length above {length}, or lower --rollout-max-response-len "
        f"below {context}"
    )


def none_admitted(pool: WorkerPool) -> str:
    """What a loop waiting for an engine waits for, with each engine refused and why."""
    refused = "".join(f"; refused: {w.refused}" for w in pool.workers.values() if w.refused)
    return f"an admitted engine (none is healthy: see GET /workers{refused})"


async def reported_context(pool: WorkerPool, url: str) -> int:
    """The engine's `context_length` from `/server_info` (0 when it does not answer it)."""
    try:
        info = await pool.get_json(url, "/server_info", pool.config.health_timeout_s)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        log.warning("%s: GET /server_info failed (%s): its context is not known", url, exc)
        return 0
    value = info.get("context_length")
    return value if isinstance(value, int) and value > 0 else 0


class ContextGate:
    """The admission check of engines by context length; `length()` is the bound in use."""

    def __init__(self, pool: WorkerPool, length: Callable[[], int]) -> None:
        self.pool, self.length = pool, length
        self.contexts: dict[str, int] = {}  # engine URL -> its reported context (0: unknown)

    async def __call__(self, url: str) -> str:
        """Why the engine at `url` must get no traffic ("" when it may). One that does not say
        now keeps the context it last said: a refused engine whose `/server_info` times out
        under load stays refused."""
        self.contexts[url] = await reported_context(self.pool, url) or self.contexts.get(url, 0)
        return context_problem(url, self.contexts[url], self.length())

    async def refuse_short(self) -> None:
        """Take out each registered engine whose context is too short, then check each later
        one as it is added; ValueError (a configuration error) when none is left."""
        refused = []
        for worker in list(self.pool.workers.values()):
            if why := await self(worker.url):
                self.pool.refuse(worker, why)
                refused.append(why)
        self.pool.vet = self
        if refused and not self.pool.admitted():
            raise ValueError("; ".join(refused))

    def patch_problem(self, length: int) -> str:
        """Why responses up to `length` tokens do not fit the smallest admitted context."""
        known = [(c, w.url) for w in self.pool.admitted() if (c := self.contexts.get(w.url))]
        if not known:
            return ""
        context, url = min(known)
        if context > length:
            return ""
        return (
            f"rollout_max_response_len {length}: engine {url} has a context length of "
            f"{context} tokens (its /server_info), which cannot hold such a response and a "
            f"prompt: give less than {context}, or restart the engine with a higher "
            "--context-length"
        )
