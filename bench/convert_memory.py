"""Peak memory of `tandem convert` (services/trainer/convert.py), both directions, as a ratio to
the bytes of the model's weights, measured on a synthetic model of a real architecture's shape.

The model: a Qwen2-0.5B-shaped `config.json` (hidden 896, 14 heads over 2 KV groups, qkv bias,
a 151,936-token vocabulary, SwiGLU of 4,864), `--layers` deep, bf16, with random weights written
with safetensors in `--shards` files and a `model.safetensors.index.json`, as published
checkpoints are. Each conversion runs as `python -m services.trainer.convert` (one at a time);
its peak memory (`peak_memory`: the PSS of it and its checkpoint writers) is printed over the
weights' bytes, also less the floor of a process that only imports what convert imports and
starts its gloo world (torch, megatron: ~0.4 GiB whatever the model), which leaves the
conversion's own memory: 1.0 = one copy of the weights. `--before DIR` measures another checkout
beside this one. The round trip HF -> megatron -> HF is checked to give back every input tensor
bit for bit.

    python bench/convert_memory.py [--layers 16] [--shards 3] [--before OLD_CHECKOUT]
Last line: `convert_peak_vs_weights: X` (this checkout's larger direction, less the floor, over
the weights' bytes; lower is better, 1.0 = the model held once).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]

QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}

# What every conversion process holds before its model: the imports and a gloo world of one.
FLOOR = (
    "import time\n"
    "from services.trainer import hf_convert\n"
    "from megatron.core import dist_checkpointing\n"
    "from services.trainer.policy import init_distributed\n"
    "init_distributed(tp_size=1, seed=0)\n"
    "time.sleep(1)\n"
)


def qwen2_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 tensors under the HF names of a Qwen2 model of `config`."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        h = f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = 1 + rand(hidden)
        out[h + "post_attention_layernorm.weight"] = 1 + rand(hidden)
        for name, rows in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            out[h + f"self_attn.{name}.weight"] = rand(rows, hidden)
            out[h + f"self_attn.{name}.bias"] = rand(rows)
        out[h + "self_attn.o_proj.weight"] = rand(hidden, hidden)
        out[h + "mlp.gate_proj.weight"] = rand(inter, hidden)
        out[h + "mlp.up_proj.weight"] = rand(inter, hidden)
        out[h + "mlp.down_proj.weight"] = rand(hidden, inter)
    out["model.norm.weight"] = 1 + rand(hidden)
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = rand(config["vocab_size"], hidden)
    return out


def write_sharded_model(folder: Path, config: dict, shards: int, seed: int = 0) -> int:
    """A HF model folder: `config.json`, `shards` safetensors files (tensors in order, split by
    bytes) and their `model.safetensors.index.json`; returns the weights' bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = qwen2_tensors(config, seed)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    names = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    weight_map, parts, done = {}, [{} for _ in names], 0
    for name, t in tensors.items():
        k = min(shards - 1, done * shards // total)
        parts[k][name], weight_map[name] = t, names[k]
        done += t.numel() * t.element_size()
    for part, file in zip(parts, names, strict=True):
        save_file(part, folder / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def peak_memory(code: Path, *args: str) -> int:
    """Peak memory in bytes of a conversion (`args`; none: `FLOOR`) run with the checkout
    `code`: the largest sum, sampled every 20 ms, of the proportional set size (PSS) of its
    process and of those it starts (megatron's checkpoint writers are forked processes, whose
    RSS would count the pages they share with it again)."""
    # (the checkout first; what PYTHONPATH held after it: packages installed beside the
    # interpreter's, as on a machine given wheels with --target)
    path = os.pathsep.join([str(code), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
    env = {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "OMP_NUM_THREADS": "1"}
    run = ["-m", "services.trainer.convert", *args] if args else ["-c", FLOOR]
    proc = subprocess.Popen(
        [sys.executable, *run],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=code,
        text=True,
    )
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        total = 0
        try:
            for each in [root, *root.children(recursive=True)]:
                total += each.memory_full_info().pss
        except psutil.Error:  # (a writer that ended while being read)
            pass
        peak = max(peak, total)
        time.sleep(0.02)
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"convert {' '.join(args)} failed:\n{stderr[-3000:]}")
    return peak


def round_trip(src: Path, out: Path) -> bool:
    """Every tensor of `src`'s shards is in `out`'s model.safetensors, bit for bit."""
    original, back = {}, load_file(out / "model.safetensors")
    for file in sorted(src.glob("*.safetensors")):
        original.update(load_file(file))
    return set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in back)


def measure(code: Path, src: Path, scratch: Path) -> tuple[int, int, int, bool]:
    """(floor, hf-to-megatron peak, megatron-to-hf peak, round trip exact) of checkout `code`."""
    ckpt, out = scratch / "mcore", scratch / "hf-back"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    floor = peak_memory(code)
    to_m = peak_memory(code, "hf-to-megatron", "--hf-dir", str(src), "--save", str(ckpt))
    to_hf = peak_memory(code, "megatron-to-hf", "--load", str(ckpt), "--out", str(out))
    return floor, to_m, to_hf, round_trip(src, out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="Decoder layers (16: 0.75 GB).")
    parser.add_argument("--shards", type=int, default=3, help="Safetensors files of the model.")
    parser.add_argument("--dir", default="", help="Scratch folder (default: a temporary one).")
    parser.add_argument(
        "--before",
        default="",
        help="Another checkout (e.g. `git worktree add` of an older "
        "commit) measured the same way, printed beside this one.",
    )
    args = parser.parse_args(argv)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="convert-bench-"))
    shutil.rmtree(scratch, ignore_errors=True)
    src = scratch / "hf"
    config = {**QWEN2_05B, "num_hidden_layers": args.layers}
    codes = {"before": Path(args.before).resolve()} if args.before else {}
    codes["now"] = ROOT
    try:
        weights = write_sharded_model(src, config, args.shards)
        results = {name: measure(code, src, scratch) for name, code in codes.items()}
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    gib = 2**30
    print(
        f"model: qwen2-shaped, {args.layers} layers, {weights / gib:.2f} GiB bf16 in "
        f"{args.shards} shards (the largest tensor, the embedding: "
        f"{config['vocab_size'] * config['hidden_size'] * 2 / weights:.2f} of it)"
    )
    print(f"{'peak / weights':34}" + "".join(f"{name:>10}" for name in results))
    rows = {
        "import floor (GiB)": [r[0] / gib for r in results.values()],
        "hf-to-megatron": [r[1] / weights for r in results.values()],
        "megatron-to-hf": [r[2] / weights for r in results.values()],
        "hf-to-megatron, less the floor": [(r[1] - r[0]) / weights for r in results.values()],
        "megatron-to-hf, less the floor": [(r[2] - r[0]) / weights for r in results.values()],
    }
    for label, values in rows.items():
        print(f"{label:34}" + "".join(f"{v:>10.2f}" for v in values))
    print(f"{'round trip bit-exact':34}" + "".join(f"{r[3]!s:>10}" for r in results.values()))
    floor, to_m, to_hf, exact = results["now"]
    print(f"convert_peak_vs_weights: {(max(to_m, to_hf) - floor) / weights:.2f}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
