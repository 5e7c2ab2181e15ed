"""Generated tokens/s of `tandem engine` vs sequential `transformers` generate, same requests.

For each model (the tiny toy Llama, and a ~112M-parameter random-init Llama): write the model,
start the engine through the real CLI (one torch thread), send `--requests` concurrent
`/generate` calls (prompt `--prompt-len` random tokens, exactly `--output-len` new tokens,
temperature 1), then run the same prompts one after another through
`model.generate` (one torch thread, KV cache on, same sampling) in this process. Both sides
count only generated tokens. For the tiny model it also times `tandem up`'s workload (64
concurrent requests of n=8, 512 sequences). The last line is the smaller of the per-model ratios:

    speedup_vs_sequential_hf: <engine tokens/s / sequential HF tokens/s>

Usage: python bench/engine_throughput.py [--models tiny,100m] [--requests 64] [--baseline-requests N]
`--baseline-requests N` times only the first N prompts sequentially (tokens/s is a rate, so it
compares fairly) to shorten the run; the default times all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

MODELS = {
    # the toy model's shape, with room for prompt + output positions
    "tiny": dict(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=10,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
}


def write_model(out: Path, shape: dict, max_positions: int) -> Path:
    """A random-init Llama with a word-level tokenizer covering its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"t{i}" for i in range(4, shape["vocab_size"])]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    config = LlamaConfig(
        **shape,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


class Engine:
    """`tandem engine` as a subprocess (killed by process group on exit)."""

    def __init__(self, model: Path, workdir: Path) -> None:
        ready = workdir / f"engine-{model.name}.ready.json"
        ready.unlink(missing_ok=True)
        self.log = workdir / f"engine-{model.name}.log"
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            "engine",
            "--model",
            str(model),
            "--port",
            "0",
            "--ready-file",
            str(ready),
            "--num-threads",
            "1",
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=open(self.log, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.url = json.loads(ready.read_text())["url"]

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)


async def engine_run(url: str, prompts: list[list[int]], output_len: int) -> tuple[int, float]:
    """(generated tokens, seconds) for all prompts sent at once."""
    params = {"max_new_tokens": output_len, "temperature": 1.0, "ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt: list[int]) -> int:
            body = {"input_ids": prompt, "sampling_params": params}
            async with session.post(f"{url}/generate", json=body) as resp:
                resp.raise_for_status()
                return (await resp.json())["meta_info"]["completion_tokens"]

        await one(prompts[0])  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts), time.perf_counter() - start


async def up_workload(url: str, rounds: int = 5) -> float:
    """Median seconds for `tandem up`'s step: 64 concurrent requests, each one 4-token prompt
    with n=8, 4 new tokens, temperature 1, logprobs (512 sequences)."""
    body = {
        "input_ids": [1, 4, 5, 14],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "n": 8},
    }
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            async with session.post(f"{url}/generate", json=body) as resp:
                resp.raise_for_status()
                assert len(await resp.json()) == 8

        times = []
        for _ in range(rounds + 1):  # the first round warms up
            start = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(64)))
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[len(times[1:]) // 2]


def hf_sequential(model_dir: Path, prompts: list[list[int]], output_len: int) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(prompt: list[int]) -> int:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
        )
        return out.shape[1] - len(prompt)

    with torch.inference_mode():
        generate(prompts[0])  # warm-up
        start = time.perf_counter()
        tokens = sum(generate(p) for p in prompts)
        return tokens, time.perf_counter() - start


def bench(name: str, args: argparse.Namespace, workdir: Path) -> float:
    shape = MODELS[name]
    model = write_model(workdir / name, shape, args.prompt_len + args.output_len + 8)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        [1, *torch.randint(4, shape["vocab_size"], (args.prompt_len - 1,), generator=gen).tolist()]
        for _ in range(args.requests)
    ]
    engine = Engine(model, workdir)
    try:
        tokens, seconds = asyncio.run(engine_run(engine.url, prompts, args.output_len))
        if name == "tiny":
            print(f"tiny/up_workload_seconds: {asyncio.run(up_workload(engine.url)):.3f}")
    finally:
        engine.stop()
    engine_rate = tokens / seconds
    print(f"{name}/engine_tokens: {tokens}")
    print(f"{name}/engine_seconds: {seconds:.2f}")
    print(f"{name}/engine_tokens_per_s: {engine_rate:.1f}", flush=True)
    subset = prompts[: args.baseline_requests or len(prompts)]
    tokens, seconds = hf_sequential(model, subset, args.output_len)
    hf_rate = tokens / seconds
    print(f"{name}/hf_sequential_requests: {len(subset)}")
    print(f"{name}/hf_sequential_seconds: {seconds:.2f}")
    print(f"{name}/hf_sequential_tokens_per_s: {hf_rate:.1f}")
    print(f"{name}/speedup_vs_sequential_hf: {engine_rate / hf_rate:.2f}", flush=True)
    return engine_rate / hf_rate


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="tiny,100m", help="comma-separated: tiny, 100m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--baseline-requests",
        type=int,
        default=0,
        help="time only this many prompts sequentially (0 = all)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"torch threads: 1 per process; cpu count {os.cpu_count()}; requests {args.requests}, "
        f"prompt {args.prompt_len}, output {args.output_len}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        ratios = [bench(name, args, Path(tmp)) for name in args.models.split(",")]
    print(f"speedup_vs_sequential_hf: {min(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
