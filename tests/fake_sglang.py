"""A stand-in SGLang engine for router tests and the overhead benchmark (not for training).

It answers the SGLang HTTP contract instantly (or after `--delay-ms`) with deterministic output:
for a toy-task prompt `<bos> a b >` sample k of n answers `b a <eos>` when k is even (the exact
answer) and `a b b b...` otherwise; greedy requests (temperature 0) always get the exact answer.
Other prompts get `4 5 <eos>`. Output is cut at `max_new_tokens` (finish "length").
`--fail-generate` makes `/generate` answer 500 (model info still answers), to test retries;
`--fail-generate 400` answers 400 as SGLang refuses a request it finds at fault.
`--context-length N` makes `/server_info` report `context_length` N, as SGLang does.
`POST /update_weights_from_disk {"model_path": ..., "weight_version": "3"}` sets the reported
weight version.

It cannot drift from SGLang: its route table and request validation come from the installed
`sglang` package's source (`tests/sglang_surface.py`, parsed, never imported). A route the pinned
SGLang does not declare answers 404, and a body with a field (or a `sampling_params` key) its
request class does not have, or a value of the wrong type, answers 400 naming it, so a test
fails when Tandem calls such a route or sends such a field. To move the pin, change
`sglang==0.5.23` in the Makefile, reinstall it (`pip install --no-deps sglang==X`) and run
`pytest tests/test_sglang_contract.py tests/test_router_*.py`.

Run: `python tests/fake_sglang.py --port 0 --ready-file F [--model-path DIR]`.
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

from services.common.serving import bind_socket, write_ready_file
from tandem.toy_model import VOCAB
from tests import sglang_surface

BOS, EOS, ARROW = 1, 2, 14


def answer_ids(prompt: list[int], k: int, greedy: bool) -> list[int]:
    """The full answer to a prompt; without EOS the last token repeats, as a model that never
    stops would."""
    if len(prompt) == 4 and prompt[0] == BOS and prompt[3] == ARROW:
        a, b = prompt[1], prompt[2]
        ids = [b, a, EOS] if greedy or k % 2 == 0 else [a, b, b]
    else:
        ids = [4, 5, EOS]
    return ids + [ids[-1]] * 4096


def split_prompt(input_ids: list[int]) -> tuple[list[int], list[int]]:
    """(prompt, tokens already generated): a toy prompt followed by more tokens is a partial
    rollout's continuation request."""
    if len(input_ids) > 4 and input_ids[0] == BOS and input_ids[3] == ARROW:
        return input_ids[:4], input_ids[4:]
    return input_ids, []


def one_output(
    state: dict[str, Any],
    input_ids: list[int],
    params: dict[str, Any],
    k: int,
    cut: int | None,
    version: int,
    top: int = 0,
) -> dict:
    """Output k of a request; `cut` = tokens produced before an abort (None: not aborted);
    `version` = the weights the tokens came from (weights never change mid-request); `top`
    (`top_logprobs_num`) alternatives a token, the sampled one first."""
    prompt, done = split_prompt(input_ids)
    full = answer_ids(prompt, k, float(params.get("temperature", 1.0)) == 0.0)[len(done) :]
    limit = int(params.get("max_new_tokens", 128))
    stop_ids = set(params.get("stop_token_ids") or []) | {EOS}
    out: list[int] = []
    finish: dict[str, Any] = {"type": "length", "length": limit}
    for tok in full[:limit]:
        if cut is not None and len(out) >= cut:
            finish = {"type": "abort", "message": "aborted"}
            break
        out.append(tok)
        if tok in stop_ids:
            finish = {"type": "stop", "matched": tok}
            break
    state["rid"] += 1
    meta = {"output_top_logprobs": [top_logprobs(i, t, top) for i, t in enumerate(out)]}
    return {
        "text": "".join(VOCAB[t] for t in out if t > 3),
        "output_ids": out,
        "meta_info": {
            "id": f"rid-{state['rid']}",
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "finish_reason": finish,
            "weight_version": str(version),
            "output_token_logprobs": [[-0.1 * (i + 1), t, None] for i, t in enumerate(out)],
            **(meta if top else {}),
        },
    }


def top_logprobs(i: int, token: int, top: int) -> list[list[Any]]:
    """SGLang's `[logprob, token_id, text]` alternatives of output token i: `token`, then
    others, each less likely."""
    others = [t for t in range(4, len(VOCAB)) if t != token][: top - 1]
    return [[-0.1 * (i + 1) - j, t, None] for j, t in enumerate([token, *others])]


def js(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


class FakeEngine:
    """Handlers over one engine's state. `token_delay_ms` > 0 makes generation take that long
    per token, so a request can be aborted midway (`/abort_request`, `/pause_generation`) and
    return its partial output."""

    def __init__(
        self,
        model_path: str,
        version: int,
        fail_generate: int,
        delay_ms: float,
        token_delay_ms: float,
        context_length: int = 0,
    ) -> None:
        self.model_path, self.fail_generate = model_path, fail_generate
        self.context_length = context_length  # 0: not reported
        self.delay_ms, self.token_delay_ms = delay_ms, token_delay_ms
        self.running = asyncio.Event()
        self.running.set()
        self.state: dict[str, Any] = {"version": version, "rid": 0, "requests": 0, "abort_epoch": 0}

    async def produced_before_abort(self, limit: int) -> int | None:
        """Sleep token by token; the number of tokens made when an abort came, else None."""
        epoch = self.state["abort_epoch"]
        for step in range(limit):
            await asyncio.sleep(self.token_delay_ms / 1000)
            if self.state["abort_epoch"] != epoch:
                return step + 1
        return None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.state["requests"] += 1
        if self.fail_generate == 500:
            return js({"error": "injected failure"}, 500)
        if self.fail_generate:
            refusal = {"message": "injected refusal of the request", "code": self.fail_generate}
            return js({"error": refusal}, self.fail_generate)
        body = request["json"]
        await self.running.wait()  # while paused, new requests wait (SGLang does the same)
        if self.delay_ms:
            await asyncio.sleep(self.delay_ms / 1000)
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        raw = body.get("sampling_params") or {}
        params = raw if isinstance(raw, list) else [raw] * len(prompts)
        limit = max(int(p.get("max_new_tokens", 128)) for p in params)
        version = self.state["version"]
        cut = await self.produced_before_abort(limit) if self.token_delay_ms else None
        # sample k counts over the whole request: copy k of a batch, or parallel sample k
        outs = []
        for prompt, p in zip(prompts, params, strict=True):
            for _ in range(int(p.get("n", 1))):
                top = int(body.get("top_logprobs_num") or 0) if body.get("return_logprob") else 0
                outs.append(one_output(self.state, prompt, p, len(outs), cut, version, top))
        if not body.get("stream"):
            return js(outs if len(outs) > 1 or batch else outs[0])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for out in outs:
            await resp.write(b"data: " + orjson.dumps(out) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def abort(self, _request: web.Request) -> web.Response:
        self.state["abort_epoch"] += 1
        return js({"success": True})

    async def pause(self, request: web.Request) -> web.Response:
        if request["json"].get("mode", "abort") == "abort":
            self.state["abort_epoch"] += 1
        self.running.clear()
        return js({"success": True})

    async def resume(self, _request: web.Request) -> web.Response:
        self.running.set()
        return js({"success": True})

    async def model_info(self, _request: web.Request) -> web.Response:
        return js(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": str(self.state["version"]),
            }
        )

    async def update_weights(self, request: web.Request) -> web.Response:
        body = request["json"]
        self.state["version"] = int(body.get("weight_version", self.state["version"] + 1))
        return js({"success": True, "message": "ok"})

    async def ok(self, _request: web.Request) -> web.Response:
        return js({"success": True, "requests": self.state["requests"]})

    async def server_info(self, _request: web.Request) -> web.Response:
        """SGLang reports its (resolved) `--context-length` here, with much more."""
        info: dict[str, Any] = {"success": True, "requests": self.state["requests"]}
        if self.context_length:
            info["context_length"] = self.context_length
        return js(info)

    async def openai(self, request: web.Request) -> web.Response:
        """Enough of an OpenAI answer to see that a request was forwarded here."""
        body = request["json"]
        return js(
            {
                "object": request.path,
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "text": "01",
                        "message": {"role": "assistant", "content": "01"},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    def app(self) -> web.Application:
        app = web.Application(middlewares=[pinned_sglang_only])
        handlers = {
            ("POST", "/generate"): self.generate,
            ("POST", "/update_weights_from_disk"): self.update_weights,
            ("POST", "/flush_cache"): self.ok,
            ("POST", "/v1/completions"): self.openai,
            ("POST", "/v1/chat/completions"): self.openai,
            ("POST", "/abort_request"): self.abort,
            ("POST", "/pause_generation"): self.pause,
            ("POST", "/continue_generation"): self.resume,
            ("GET", "/get_model_info"): self.model_info,
            ("GET", "/model_info"): self.model_info,
            ("GET", "/health"): self.ok,
            ("GET", "/health_generate"): self.ok,
            ("GET", "/get_server_info"): self.server_info,
            ("GET", "/server_info"): self.server_info,
        }
        missing = set(handlers) - set(sglang_surface.routes())
        if missing:  # the stand-in must not serve what the pinned SGLang does not
            raise RuntimeError(f"SGLang {sglang_surface.version()} has no route {missing}")
        for (method, path), handler in handlers.items():
            app.router.add_route(method, path, handler)
        return app


@web.middleware
async def pinned_sglang_only(request: web.Request, handler: Any) -> web.StreamResponse:
    """404 for a route the pinned SGLang does not declare; 400 naming the field for a body its
    request class (io_struct) would not take. The parsed body is `request["json"]`."""
    route = sglang_surface.routes().get((request.method, request.path))
    if route is None:
        return js(
            {
                "detail": f"Not Found: SGLang {sglang_surface.version()} has no route "
                f"{request.method} {request.path}"
            },
            404,
        )
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        return js({"error": f"body is not JSON: {exc}"}, 400)
    problem = None
    if request.path == "/generate":
        problem = sglang_surface.generate_problem(body)
    elif route.body_class is not None and request.method != "GET":
        problem = sglang_surface.check_body(route.body_class, body)
    if problem is not None:
        return js({"error": {"message": problem, "code": 400}}, 400)
    request["json"] = body
    return await handler(request)


class FakeEngineProcess:
    """The fake engine as a subprocess (own session; `stop()` kills it by process group)."""

    def __init__(self, workdir: Path, name: str, *flags: str, timeout_s: float = 30.0) -> None:
        self.ready_file = Path(workdir) / f"{name}.ready.json"
        self.ready_file.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--ready-file",
            str(self.ready_file),
            *flags,
        ]
        # the repository first: the stand-in imports `tests.sglang_surface` and `services`
        root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            cmd,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
        )
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake engine {name} did not start ({cmd})")
            time.sleep(0.02)
        self.url: str = json.loads(self.ready_file.read_text())["url"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fake_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--model-path", default="/nonexistent/fake-model")
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--fail-generate", type=int, nargs="?", const=500, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--context-length", type=int, default=0, help="reported in /server_info")
    args = parser.parse_args(argv)
    engine = FakeEngine(
        args.model_path,
        args.weight_version,
        args.fail_generate,
        args.delay_ms,
        args.token_delay_ms,
        args.context_length,
    )
    app = engine.app()
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]

    async def serve_forever() -> None:
        runner = web.AppRunner(app, access_log=None)
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
    sys.exit(main(sys.argv[1:]))
