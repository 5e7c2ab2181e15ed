"""An arithmetic environment with a calculator tool, served over Tandem's environment protocol.

Each episode asks one question, `What is A op B?` (from the episode's seed), as a chat message,
and offers one tool, `calculator(expression)`. A model turn with tool calls (the router parses
them; `--env-tool-call-parser hermes`, the default) is answered with one `tool` message per
call: the value, or an error for an unknown tool, a bad expression, or a call the router could
not parse (`tool_call_errors`); the episode goes on. A turn without tool calls is the answer:
reward 1 when its last number equals the value, else 0, and the episode ends. After
`--max-turns` turns it ends with reward 0.

Protocol (documented in docs/protocols.md):
    POST /reset {"episode_id", "seed", "task"} -> {"observation": [messages], "tools": [...]}
    POST /step  {"episode_id", "action", "tool_calls", "tool_call_errors"}
                -> {"observation": [tool messages], "reward", "done"}

Run it, then point the router at it:
    python examples/calc_env.py --port 8011
    tandem up --env-url http://127.0.0.1:8011 --env-max-turns 4
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_EPISODES = 10_000  # open episodes kept; the oldest are forgotten beyond this
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
OPERATORS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3+4)*12"}},
            "required": ["expression"],
        },
    },
}


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything else."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported element {type(node).__name__}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression ({exc.msg})") from exc
    except ZeroDivisionError as exc:
        raise ValueError("division by zero") from exc


def show(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else f"{number:.6g}"


def tool_reply(call: dict[str, Any]) -> str:
    if call.get("name") != "calculator":
        return f"error: unknown tool {call.get('name')!r} (the tool is calculator)"
    expression = call.get("arguments", {}).get("expression")
    if not isinstance(expression, str):
        return 'error: calculator needs {"expression": "..."}'
    try:
        return show(evaluate(expression))
    except ValueError as exc:
        return f"error: {exc}"


class Calc:
    """Episode state: the expected value and turns so far, per episode id (thread-safe)."""

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns
        self.episodes: OrderedDict[str, list[float]] = OrderedDict()
        self.lock = threading.Lock()

    def reset(self, episode_id: str, seed: int) -> dict[str, Any]:
        rng = random.Random(seed)
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-*")
        with self.lock:
            self.episodes[episode_id] = [evaluate(f"{a}{op}{b}"), 0]
            while len(self.episodes) > MAX_EPISODES:
                self.episodes.popitem(last=False)
        question = f"What is {a}{op}{b}? Use the calculator."
        return {"observation": [{"role": "user", "content": question}], "tools": [CALCULATOR]}

    def step(self, episode_id: str, action: str, calls: list, errors: list) -> dict[str, Any]:
        with self.lock:
            expected, turns = self.episodes[episode_id]
            self.episodes[episode_id][1] = turns = turns + 1
            if (not calls and not errors) or turns >= self.max_turns:
                del self.episodes[episode_id]
        if not calls and not errors:  # the answer
            numbers = NUMBER.findall(action)
            right = bool(numbers) and abs(float(numbers[-1]) - expected) < 1e-6
            return {"observation": "", "reward": float(right), "done": True}
        replies = [tool_reply(call) for call in calls] + [f"error: {e}" for e in errors]
        observation = [{"role": "tool", "content": reply} for reply in replies]
        return {"observation": observation, "reward": 0.0, "done": turns >= self.max_turns}


def make_handler(calc: Calc) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the router reuses its connections

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            try:
                if self.path == "/reset":
                    reply = calc.reset(body["episode_id"], int(body.get("seed", 0)))
                elif self.path == "/step":
                    reply = calc.step(
                        body["episode_id"],
                        str(body.get("action", "")),
                        body.get("tool_calls") or [],
                        body.get("tool_call_errors") or [],
                    )
                else:
                    return self.answer(404, {"error": f"no route {self.path}"})
            except KeyError as exc:
                return self.answer(400, {"error": f"unknown episode or field: {exc}"})
            self.answer(200, reply)

        def answer(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()
    # A batch opens hundreds of episodes at once: a deep accept queue keeps connects from
    # waiting on SYN retries.
    ThreadingHTTPServer.request_queue_size = 1024
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer((args.host, args.port), make_handler(Calc(args.max_turns)))
    print(f"calc env on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
