"""A worker that answers SGLang's routes at once, for measuring routers rather than engines.

A toy-task prompt `<bos> a b >` (`tandem/toy_model.py`) gets `b a <eos>` (the right answer) for
even sample numbers k and `a b <eos>` for odd ones, so every group has a reward spread; any other
prompt gets `4 5 <eos>`. Answers are cut at `max_new_tokens` and carry made-up log-probs, in
SGLang 0.5.23's `/generate` answer shape: one object, or a list for `n` > 1 and for a batch of
prompts. Unlike the test stand-in (which rejects any field the pinned SGLang does not declare),
it takes any body, as SGLang does: the Rust `sglang-router` adds fields of its own (`model`) to
what it forwards. It serves only what a router calls: health, model and server info, `/generate`
and the pause/flush/abort controls (always `success`).

    python bench/instant_worker.py --port 0 --ready-file F [--model-path DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.serving import bind_socket, write_ready_file  # noqa: E402

BOS, EOS, ARROW = 1, 2, 14


def one_output(prompt: list[int], params: dict[str, Any], k: int, rid: int) -> dict[str, Any]:
    """Sample k of a request (k counts over the whole request, batch copies included)."""
    if len(prompt) == 4 and prompt[0] == BOS and prompt[3] == ARROW:
        a, b = prompt[1], prompt[2]
        answer = [b, a, EOS] if k % 2 == 0 else [a, b, EOS]
    else:
        answer = [4, 5, EOS]
    out = answer[: int(params.get("max_new_tokens", 128))]
    finish = {"type": "stop", "matched": EOS} if out[-1:] == [EOS] else {"type": "length"}
    return {
        "text": "",
        "output_ids": out,
        "meta_info": {
            "id": f"rid-{rid}",
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "finish_reason": finish,
            "weight_version": "0",
            "output_token_logprobs": [[-0.1, t, None] for t in out],
        },
    }


def js(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


def make_app(model_path: str) -> web.Application:
    rids = iter(range(1 << 62))

    async def generate(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        raw = body.get("sampling_params") or {}
        params = raw if isinstance(raw, list) else [raw] * len(prompts)
        outs: list[dict[str, Any]] = []
        for prompt, p in zip(prompts, params, strict=True):
            for _ in range(int(p.get("n", 1))):
                outs.append(one_output(prompt, p, len(outs), next(rids)))
        return js(outs if len(outs) > 1 or batch else outs[0])

    async def info(_request: web.Request) -> web.Response:
        return js(
            {
                "model_path": model_path,
                "tokenizer_path": model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "0",
            }
        )

    async def ok(_request: web.Request) -> web.Response:
        return js({"success": True})

    app = web.Application()
    app.router.add_post("/generate", generate)
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        app.router.add_get(path, info)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, ok)
    for path in ("/flush_cache", "/abort_request", "/pause_generation", "/continue_generation"):
        app.router.add_post(path, ok)
    return app


class InstantWorkerProcess:
    """This module as a subprocess (own session; `stop()` ends its process group)."""

    def __init__(self, workdir: Path, name: str, model_path: Path, timeout_s: float = 30.0):
        ready = Path(workdir) / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            __file__,
            "--ready-file",
            str(ready),
            "--model-path",
            str(model_path),
        ]
        self.proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"instant worker {name} did not start in {timeout_s} s: {cmd}")
            time.sleep(0.02)
        self.url: str = json.loads(ready.read_text())["url"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--model-path", default="/nonexistent/model")
    args = parser.parse_args()
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]

    async def serve_forever() -> None:
        runner = web.AppRunner(make_app(args.model_path), access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        if args.ready_file:
            url = f"http://{args.host}:{port}"
            write_ready_file(args.ready_file, url=url, host=args.host, port=port)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        asyncio.run(serve_forever())
    return 0


if __name__ == "__main__":
    sys.exit(main())
