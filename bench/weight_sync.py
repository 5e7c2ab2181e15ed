"""Weight sync: one version from the trainer side to every engine, against the physical limit.

Measured in one run, on a synthetic Llama (real parameter names, `--size-gb` of weights):
  - the limit: CPU, a raw memcpy of the same bytes (torch copy_); CUDA, a raw
    `torch.distributed.broadcast` of the same bytes from GPU 0 to GPU 1 (NCCL);
  - Tandem's sync to 1 and to 2 real engines (`tandem engine`), through a real `tandem broker`:
    from the moment the trainer-side sender gets the tensors until every engine serves the
    version (the broker reports it), including every HTTP call, transfer, load and cache flush.

CPU, one host (ZMQ carries headers, the payload goes through /dev/shm; `--transport zmq`
sends it in ZMQ frames instead):
    python bench/weight_sync.py --size-gb 1
CUDA, NCCL transport (trainer on GPU 0, engines on GPUs 1 and 2, started with random weights
of the right shapes, `--load-format dummy`); `--source megatron` starts each version from a
megatron model on GPU 0, so the timing includes the trainer's conversion to HF names too:
    python bench/weight_sync.py --device cuda --transport nccl --dtype bfloat16 --size-gb 2 16 \
        --source megatron
(`--nccl-load-format per_tensor` measures one broadcast per tensor, as for older SGLang.)
Last line: `sync_vs_limit_1_engine: RATIO` (limit time / sync time, higher is better).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

HIDDEN, INTER, HEADS, KV = 2048, 5632, 16, 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gb", type=float, nargs="+", default=[1.0], help="model sizes (GiB)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--transport",
        default="shm",
        choices=["shm", "zmq", "nccl"],
        help="shm: ZMQ headers + a shared-memory payload (one host); zmq: payload in "
        "ZMQ frames; nccl: broadcast into the engines' weight group",
    )
    p.add_argument(
        "--nccl-load-format",
        default="flattened_bucket",
        choices=["flattened_bucket", "per_tensor"],
        help="nccl transport: the broker's --nccl-load-format",
    )
    p.add_argument(
        "--source",
        default="hf",
        choices=["hf", "megatron"],
        help="hf: HF-named tensors ready on the trainer side; megatron: each version is "
        "exported from a megatron model (TP=1) inside the timed region, as the trainer does",
    )
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2], help="engine counts to run")
    p.add_argument("--repeats", type=int, default=3, help="versions sent per setting (median)")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument(
        "--hidden-size", type=int, default=HIDDEN, help="synthetic model width (FFN 2.75x)"
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=0,
        help="synthetic model depth (9 tensors a layer + 3; 0 = from --size-gb). 182 layers = "
        "1,641 tensors, an 8B-shaped version's count",
    )
    p.add_argument(
        "--layout-id",
        default="on",
        choices=["on", "off", "compare"],
        help="nccl transport: offer a layout_id (on), never (off), or measure both with one "
        "engine and report what the id saves per version (compare)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=120, help="bound of every wait (a hang fails)"
    )
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tandem-bench-sync"))
    return p.parse_args()


def synthetic_model(
    root: Path, size_gb: float, dtype: str, weights: bool = True, layers: int = 0
) -> Path:
    """An HF Llama directory of about `size_gb` GiB (layers of hidden 2048), built once;
    without `weights`, only its config and tokenizer (for engines with `--load-format dummy`)."""
    from safetensors.torch import save_file

    from tandem.toy_model import build_tokenizer

    elem = 4 if dtype == "float32" else 2
    per_layer = (
        2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN * KV // HEADS + 3 * HIDDEN * INTER
    ) * elem
    layers = layers or max(1, round(size_gb * 2**30 / per_layer))
    out = root / f"llama-{layers}l-{HIDDEN}h-{dtype}{'' if weights else '-config'}"
    if (out / ("model.safetensors" if weights else "config.json")).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "hidden_act": "silu",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(out)
    if not weights:
        return out
    save_file(
        {name: t for name, t in synthetic_tensors(layers, vocab, getattr(torch, dtype), "cpu")},
        str(out / "model.safetensors"),
    )
    return out


def synthetic_tensors(layers: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(dtype)

    kv = HIDDEN * KV // HEADS
    yield "model.embed_tokens.weight", rand(vocab, HIDDEN)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", rand(HIDDEN, HIDDEN)
        yield p + "self_attn.k_proj.weight", rand(kv, HIDDEN)
        yield p + "self_attn.v_proj.weight", rand(kv, HIDDEN)
        yield p + "self_attn.o_proj.weight", rand(HIDDEN, HIDDEN)
        yield p + "mlp.gate_proj.weight", rand(INTER, HIDDEN)
        yield p + "mlp.up_proj.weight", rand(INTER, HIDDEN)
        yield p + "mlp.down_proj.weight", rand(HIDDEN, INTER)
        yield p + "input_layernorm.weight", torch.ones(HIDDEN, dtype=dtype, device=device)
        yield p + "post_attention_layernorm.weight", torch.ones(HIDDEN, dtype=dtype, device=device)
    yield "model.norm.weight", torch.ones(HIDDEN, dtype=dtype, device=device)
    yield "lm_head.weight", rand(vocab, HIDDEN)


class Proc:
    """A `tandem` service process with a ready file; stopped with the bench."""

    def __init__(self, name: str, args: list[str], workdir: Path, env: dict | None = None):
        self.ready = workdir / f"{name}.ready.json"
        self.ready.unlink(missing_ok=True)
        self.log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            *args,
            "--port",
            "0",
            "--ready-file",
            str(self.ready),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.name = name

    def wait(self, timeout_s: float = 600) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.flush()
                tail = Path(self.log.name).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} did not start ({self.log.name}):\n{tail}")
            time.sleep(0.2)
        return json.loads(self.ready.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_T0 = time.monotonic()


def progress(message: str) -> None:
    """Progress on stderr (the table stays on stdout)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.load(resp)


def limit_seconds(args: argparse.Namespace, tensors: list, nbytes: int) -> float:
    """The physical limit for moving these bytes once (median of repeats)."""
    if args.device == "cpu":
        flat = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no page faults in the timing
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            offset = 0
            for _name, t in tensors:
                view = t.reshape(-1).view(torch.uint8)
                flat[offset : offset + view.numel()].copy_(view)
                offset += view.numel()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    script = Path(__file__).with_name("nccl_broadcast_peer.py")
    out = subprocess.run(
        [sys.executable, str(script), "--nbytes", str(nbytes), "--repeats", str(args.repeats)],
        capture_output=True,
        text=True,
        timeout=args.timeout_s * 2,
    )
    if out.returncode != 0:
        raise RuntimeError(f"raw broadcast failed:\n{out.stdout}\n{out.stderr}")
    return float(out.stdout.strip().splitlines()[-1])


def megatron_export(model_dir: Path, dtype: str):  # type: ignore[no-untyped-def]
    """A megatron model shaped like `model_dir`'s config on this GPU, and the trainer's export
    of its weights to HF names (TP=1, on the device: what the NCCL path sends)."""
    from services.trainer import hf_convert
    from services.trainer.policy import init_distributed

    init_distributed(tp_size=1, seed=0)
    arch = hf_convert.arch_from_config(json.loads((model_dir / "config.json").read_text()))
    config = hf_convert.transformer_config(arch, 1, bf16=dtype == "bfloat16")
    model = hf_convert.build_gpt_model(arch, config, 128)
    if torch.cuda.is_available():
        model.cuda()  # as the trainer does: megatron leaves torch's norms on the CPU
    return lambda: hf_convert.export_hf(model, arch, on_device=True)


def make_sender(args: argparse.Namespace, endpoint: str) -> Any:
    from services.weight_sync.nccl_sender import NcclWeightSender
    from services.weight_sync.zmq_transport import ZmqWeightSender

    bucket = args.bucket_mb * 2**20
    if args.transport == "nccl":
        layout_ids = args.layout_id == "on"
        return NcclWeightSender(
            endpoint, bucket_bytes=bucket, timeout_s=args.timeout_s, layout_ids=layout_ids
        )
    shm = "/dev/shm" if args.transport == "shm" else None
    return ZmqWeightSender(endpoint, bucket_bytes=bucket, timeout_s=args.timeout_s, shm_dir=shm)


def sync_seconds(args: argparse.Namespace, model: Path, tensors, n: int, work: Path) -> float:  # type: ignore[no-untyped-def]
    """Median seconds per version; `tensors` is the list to send, or a function making it."""

    dummy = ["--load-format", "dummy"] if args.device == "cuda" else []
    engines = [
        Proc(
            f"engine{i}",
            [
                "engine",
                "--model",
                str(model),
                "--device",
                args.device,
                "--update-timeout-s",
                str(args.timeout_s),
                *dummy,
            ],
            work,
            {"CUDA_VISIBLE_DEVICES": str(i + 1)} if args.device == "cuda" else None,
        )
        for i in range(n)
    ]
    procs: list[Proc] = list(engines)
    try:
        urls = [e.wait(args.timeout_s)["url"] for e in engines]
        progress(f"{n} engine(s) ready")
        transport = "nccl" if args.transport == "nccl" else "zmq"
        load_format = ["--nccl-load-format", args.nccl_load_format] if transport == "nccl" else []
        broker = Proc(
            "broker",
            [
                "broker",
                "--transport",
                transport,
                "--sync-timeout-s",
                str(args.timeout_s),
                *load_format,
                "--engine-urls",
                *urls,
            ],
            work,
        )
        procs.append(broker)
        info = broker.wait(args.timeout_s)
        progress("broker ready")
        sender = make_sender(args, info["intake_endpoint"])
        times = []
        for version in range(1, args.repeats + 2):  # the first version (group set-up) is warm-up
            start = time.perf_counter()
            sender.send(version, tensors() if callable(tensors) else tensors)
            # The NCCL sender returns once the broker has every engine on the version (its
            # `done`); the ZMQ senders once the broker holds the version: poll for the rest.
            seconds = time.perf_counter() - start
            while not all(
                e["version"] == version for e in get_json(f"{info['url']}/state")["engines"]
            ):
                time.sleep(0.002)
            if args.transport != "nccl":
                seconds = time.perf_counter() - start
            broadcast = getattr(sender, "broadcast_s", 0.0)
            progress(f"version {version}: {seconds:.3f}s (trainer's broadcasts {broadcast:.3f}s)")
            if version > 1:
                times.append(seconds)
        sender.close()
        for engine in engines:  # the engines' own account of receiving and applying
            lines = Path(engine.log.name).read_text(errors="replace").splitlines()
            for line in [x for x in lines if "weights:" in x or "received" in x][-3:]:
                progress(f"{engine.name}: {line.strip()[-120:]}")
        return statistics.median(times)
    finally:
        for proc in reversed(procs):
            proc.stop()


def compare_layout_ids(args: argparse.Namespace, model: Path, tensors, work: Path) -> float:  # type: ignore[no-untyped-def]
    """Seconds per version with and without `layout_id` (one engine); returns off / on."""
    seconds = {}
    for mode in ("on", "off"):
        args.layout_id = mode
        seconds[mode] = sync_seconds(args, model, tensors, 1, work)
    count = len(tensors() if callable(tensors) else tensors)
    saved = seconds["off"] - seconds["on"]
    print(
        f"layout_id on: {seconds['on']:.4f} s, off: {seconds['off']:.4f} s per version "
        f"({count} tensors): the id saves {1e3 * saved:.1f} ms a version"
    )
    return seconds["off"] / seconds["on"]


def main() -> int:
    args = parse_args()
    global HIDDEN, INTER
    HIDDEN, INTER = args.hidden_size, args.hidden_size * 11 // 4
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    headline = float("nan")
    print(
        f"device {args.device}, transport {args.transport}, dtype {args.dtype}, "
        f"source {args.source}"
    )
    print(
        f"{'size':>8} {'engines':>7} {'sync s':>8} {'GB/s':>7} {'limit s':>8} {'limit GB/s':>10} {'sync/limit':>10}"
    )
    for size in args.size_gb:
        model = synthetic_model(
            work, size, args.dtype, weights=args.device == "cpu", layers=args.num_layers
        )
        config = json.loads((model / "config.json").read_text())
        device = "cuda:0" if args.device == "cuda" else "cpu"
        if args.source == "megatron":
            tensors = megatron_export(model, args.dtype)
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors())
        else:
            tensors = list(
                synthetic_tensors(
                    config["num_hidden_layers"],
                    config["vocab_size"],
                    getattr(torch, args.dtype),
                    device,
                    seed=1,
                )
            )
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        progress(f"{nbytes / 2**30:.2f} GiB of weights ready ({args.source}); measuring the limit")
        limit = limit_seconds(args, tensors if isinstance(tensors, list) else tensors(), nbytes)
        progress(f"limit {limit:.4f}s")
        if args.layout_id == "compare":
            ratio = compare_layout_ids(args, model, tensors, work)
            print(f"layout_id_off_vs_on_time: {ratio:.2f}")
            return 0
        one = None
        for n in args.engines:
            seconds = sync_seconds(args, model, tensors, n, work)
            one = one or seconds
            ratio = limit / seconds
            print(
                f"{nbytes / 2**30:7.2f}G {n:7d} {seconds:8.3f} {nbytes / seconds / 1e9:7.2f} "
                f"{limit:8.3f} {nbytes / limit / 1e9:10.2f} {ratio:10.2f}",
                flush=True,
            )
            if n == 1:
                headline = ratio
            else:
                print(f"fan_out_{n}_vs_1_time: {seconds / one:.2f}")
    print(f"sync_vs_limit_1_engine: {headline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
