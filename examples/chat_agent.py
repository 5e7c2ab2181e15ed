"""An agent that talks to the model through the router's OpenAI API and is trained on.

Each episode is one chat session on the reverse-digits task: the agent asks `37>` and, when the
answer is wrong, says so once and lets the model try again (a second turn). It scores the last
answer itself and posts the reward; the router turns the session's exact tokens into a training
sample. Sessions of one digit pair share a group, so the trainer can compare them (GRPO).

Run against `tandem up` (it prints the router's URL and where the API token is):
    tandem up --no-rollout      # train only on what agents send
    python examples/chat_agent.py --router-url http://127.0.0.1:PORT \
        --api-token-file RUN_DIR/api_token --groups 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import AuthenticationError, OpenAI


def reward(text: str, label: str, stopped: bool) -> float:
    """A third per right digit, a third for stopping right after them (as the built-in task)."""
    score = sum(1.0 for i in range(2) if i < len(text) and text[i] == label[i])
    return (score + (1.0 if stopped and len(text) == 2 else 0.0)) / 3.0


def episode(
    client: OpenAI, router_url: str, prompt: str, label: str, group: str, size: int
) -> float:
    """One session, its reward posted (with the client's token, as every write of the API)."""
    session = uuid.uuid4().hex
    headers = {"X-Session-Id": session}
    messages = [{"role": "user", "content": prompt}]
    for _turn in range(2):
        reply = client.chat.completions.create(
            model="tandem", messages=messages, max_tokens=4, temperature=1.0, extra_headers=headers
        )
        text = reply.choices[0].message.content or ""
        score = reward(text, label, reply.choices[0].finish_reason == "stop")
        if score == 1.0:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": prompt}]
    body = json.dumps({"reward": score, "group": group, "group_size": size}).encode()
    request = urllib.request.Request(
        f"{router_url}/sessions/{session}/reward",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {client.api_key}"},
    )
    urllib.request.urlopen(request, timeout=30).read()
    return score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--router-url", required=True)
    parser.add_argument("--groups", type=int, default=100, help="digit pairs to play")
    parser.add_argument("--group-size", type=int, default=8, help="sessions per digit pair")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--api-token-file",
        default="",
        help="file holding the router's API token (tandem up: RUN_DIR/api_token; default: the "
        "env TANDEM_API_TOKEN)",
    )
    args = parser.parse_args()
    token = os.environ.get("TANDEM_API_TOKEN", "")
    if args.api_token_file:
        token = Path(args.api_token_file).read_text().strip()
    client = OpenAI(base_url=f"{args.router_url}/v1", api_key=token or "none")
    rng = random.Random(args.seed)
    jobs = []
    for g in range(args.groups):
        a, b = rng.randrange(10), rng.randrange(10)
        jobs += [(f"{a}{b}>", f"{b}{a}", f"{args.seed}-{g}")] * args.group_size
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            scores = list(
                pool.map(lambda job: episode(client, args.router_url, *job, args.group_size), jobs)
            )
    except AuthenticationError:
        sys.exit(
            f"chat_agent: the router at {args.router_url} wants its API token: pass "
            "--api-token-file RUN_DIR/api_token (tandem up says where it is) or set TANDEM_API_TOKEN"
        )
    print(f"episodes: {len(scores)}  mean reward: {sum(scores) / len(scores):.3f}")


if __name__ == "__main__":
    main()
