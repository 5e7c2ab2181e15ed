"""A multi-turn number-guessing environment served over Tandem's environment protocol.

The environment picks a secret digit (0-9) per episode. Each model turn is a guess: the first
digit in the model's text. A right guess ends the episode with reward 1; otherwise the reply is
`1>` (the secret is higher) or `0>` (lower) and the model guesses again, up to `--max-guesses`.
Observations use only digits and `>`, so the built-in toy model can play.

Protocol (documented in docs/protocols.md):
    POST /reset {"episode_id", "seed", "task"} -> {"observation"}
    POST /step  {"episode_id", "action"}        -> {"observation", "reward", "done"}

Run it, then point the router at it:
    python examples/guess_env.py --port 8010
    tandem up --env-url http://127.0.0.1:8010 --env-max-turns 4
"""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_EPISODES = 10_000  # open episodes kept; the oldest are forgotten beyond this


class Game:
    """Episode state: secret digit and guesses so far, per episode id (thread-safe)."""

    def __init__(self, max_guesses: int) -> None:
        self.max_guesses = max_guesses
        self.episodes: OrderedDict[str, list[int]] = OrderedDict()
        self.lock = threading.Lock()

    def reset(self, episode_id: str, seed: int) -> dict:
        with self.lock:
            self.episodes[episode_id] = [random.Random(seed).randrange(10), 0]
            while len(self.episodes) > MAX_EPISODES:
                self.episodes.popitem(last=False)
        return {"observation": ">"}

    def step(self, episode_id: str, action: str) -> dict:
        match = re.search(r"\d", action)
        guess = int(match.group()) if match else None
        with self.lock:
            secret, guesses = self.episodes[episode_id]
            guesses += 1
            done = guess == secret or guesses >= self.max_guesses
            if done:
                del self.episodes[episode_id]
            else:
                self.episodes[episode_id][1] = guesses
        if guess == secret:
            return {"observation": "", "reward": 1.0, "done": True}
        hint = "1>" if guess is None or secret > guess else "0>"
        return {"observation": hint, "reward": 0.0, "done": done}


def make_handler(game: Game) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the router reuses its connections

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            try:
                if self.path == "/reset":
                    reply = game.reset(body["episode_id"], int(body.get("seed", 0)))
                elif self.path == "/step":
                    reply = game.step(body["episode_id"], str(body.get("action", "")))
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
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--max-guesses", type=int, default=4)
    args = parser.parse_args()
    # A batch opens hundreds of episodes at once: a deep accept queue keeps connects from
    # waiting on SYN retries.
    ThreadingHTTPServer.request_queue_size = 1024
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer((args.host, args.port), make_handler(Game(args.max_guesses)))
    print(f"guess env on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
