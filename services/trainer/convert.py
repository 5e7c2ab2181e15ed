"""`tandem convert`: Hugging Face <-> megatron dist checkpoint (every `proto.models` type).

  hf-to-megatron --hf-dir HF --save DIR      writes DIR/iter_0000000 (weights only) and the
                                             tracker; `tandem trainer --load DIR` starts from it
  megatron-to-hf --load DIR --out HF2        writes config.json + model.safetensors (over 5 GB:
                                             shards and their index, as HF does) from any
                                             trainer or converted checkpoint (any TP it was
                                             saved at), with the tokenizer files of the
                                             model it was trained from (`hf_source`) or of
                                             `--hf-dir`

Both build the model in the dtype of the HF `config.json` (bf16 or fp32), so a bf16 model costs
bf16 memory and disk. Vocabulary padding goes both ways: rows are padded to the megatron
vocabulary on the way in and cut to the HF `vocab_size` on the way out. Runs as one process (gloo world of one); checkpoints
reshard on load, so the result loads at any tensor-parallel size.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from proto.models import read_config
from services.common.hf_weights import weight_files
from services.common.paths import unwritable

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
# The most bytes of tensors a written weights file holds: HF's own (save_pretrained's "5GB").
MAX_SHARD_BYTES = 5 * 10**9


def write_hf_dir(
    tensors: Mapping[str, Any] | Callable[[], Iterable[tuple[str, Any]]],
    config_json: str,
    out: str,
    tokenizer_src: str,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """`out` as a complete HF directory: config.json, the weights (model.safetensors, or shards
    of `max_shard_bytes` and their index: `write_safetensors`) and the tokenizer files of
    `tokenizer_src` ("" = none). Written to `out.tmp` and renamed, so `out` is never half
    written (`out.tmp` is removed when writing fails); a previous `out` is replaced. Floating
    tensors are written in the dtype the config states (a bf16 model trained in fp32, on a
    CPU, was written in fp32 under a config saying bfloat16: twice the disk, and not what the
    config tells a loader), a tensor at a time (`write_safetensors`: `tensors` may be a
    function yielding views of the model's parameters, made one at a time)."""
    import torch

    from services.trainer.hf_files import write_safetensors

    out_dir = Path(out)
    tmp, old = out_dir.with_name(out_dir.name + ".tmp"), out_dir.with_name(out_dir.name + ".old")
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads(config_json)
    dtype = getattr(torch, stated_dtype(config), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        dtype = None
    named = tensors if callable(tensors) else tensors.items
    try:
        write_safetensors(tmp, named, dtype, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in TOKENIZER_FILES if tokenizer_src else ():
            if (Path(tokenizer_src) / name).is_file():
                shutil.copy(Path(tokenizer_src) / name, tmp / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def say(started: float, what: str) -> None:
    """A progress line (a large model's conversion takes minutes)."""
    print(f"tandem convert: {what} ({time.monotonic() - started:.0f} s)", flush=True)


def is_bf16(config: dict[str, Any]) -> bool:
    """The weights of a HF `config.json` are bfloat16 (`stated_dtype`): the model is then
    built and written in bf16, not fp32 (half the memory and the disk)."""
    return stated_dtype(config) == "bfloat16"


def stated_dtype(config: dict[str, Any]) -> str:
    """The dtype a HF `config.json` gives its weights (`dtype`, or the older `torch_dtype`;
    "" when none)."""
    return str(config.get("dtype") or config.get("torch_dtype") or "")


def uninitialized_config(arch: Any, bf16: bool) -> Any:
    """The model's TransformerConfig without megatron's random initialization, which every
    weight read replaces: it made each weight first in fp32 on the CPU, a transient (the
    embedding's, twice a bf16 model's largest tensor) that the allocator then kept."""
    from services.trainer import hf_convert

    config = hf_convert.transformer_config(arch, bf16=bf16)
    config.perform_initialization = False
    return config


def hf_to_megatron(hf_dir: str, save: str, vocab_divisible_by: int = 128) -> Path:
    """Convert and save; returns the iteration directory."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from services.trainer import hf_convert
    from services.trainer.ckpt_folder import TRACKER, iteration_dir
    from services.trainer.policy import init_distributed

    started = time.monotonic()
    init_distributed(tp_size=1, seed=0)
    config, config_path = read_config(hf_dir, "--hf-dir")
    arch = hf_convert.arch_from_config(config, config_path)
    bf16 = is_bf16(config)
    model = hf_convert.build_gpt_model(arch, uninitialized_config(arch, bf16), vocab_divisible_by)
    size = sum(f.stat().st_size for f in weight_files(hf_dir))
    params = sum(p.numel() for p in model.parameters())
    say(
        started,
        f"reading {size / 2**20:,.1f} MiB of weights of {hf_dir} into a {arch.model_type} model "
        f"of {params:,} parameters, {'bf16' if bf16 else 'fp32'}",
    )
    hf_convert.load_hf_into_model(model, arch, hf_convert.load_hf_state(hf_dir, "--hf-dir"))
    path = iteration_dir(save, 0)
    path.mkdir(parents=True, exist_ok=True)
    say(started, f"writing {path}")
    state = {
        "model": sharded_for_save(model),
        "hf_config": Path(config_path).read_text(),  # (as written: megatron-to-hf gives it back)
        "hf_source": str(Path(hf_dir).resolve()),
        "padded_vocab_size": model.vocab_size,
        "has_optimizer": False,
        "version": 0,
    }
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    (Path(save) / TRACKER).write_text("0")
    return path


def sharded_for_save(model: Any) -> dict[str, Any]:
    """`model`'s sharded state dict to save, which takes the model's memory: megatron saves each
    SwiGLU `linear_fc1` as its gate and up halves, views of the parameter that its writer
    clones (it clones every view), a copy of every fc1 at once, half the model again. Here each
    half gets its own storage and the parameter's is released, a layer at a time: the model is
    not usable afterwards."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    params = dict(model.named_parameters())
    sharded = model.sharded_state_dict()
    for key, value in list(sharded.items()):
        if isinstance(value, ShardedTensorFactory) and key in params:
            halves = value.build()
            for half in halves:
                half.data = half.data.clone()
            sharded[key] = halves
            params[key].data = torch.empty(0, dtype=params[key].dtype)
    return sharded


def megatron_to_hf(load: str, out: str, ckpt_step: int = -1, hf_dir: str = "") -> Path:
    """Write HF `config.json` + the weights (`write_hf_dir`) of a checkpoint, and the tokenizer files of
    `hf_dir` or else of the model it was trained from; returns `out`."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from services.trainer import hf_convert
    from services.trainer.ckpt_folder import check_files, damaged, resolve_iteration
    from services.trainer.policy import init_distributed

    started = time.monotonic()
    init_distributed(tp_size=1, seed=0)
    path = resolve_iteration(load, ckpt_step)
    check_files(path, resume=False)  # (before a model of its size is built)
    try:
        if not (path / "common.pt").is_file():  # (megatron's own error is an AttributeError)
            raise FileNotFoundError(f"{path / 'common.pt'} is missing")
        common = dist_checkpointing.load_common_state_dict(str(path))
    except (EOFError, pickle.UnpicklingError, OSError, RuntimeError) as exc:
        raise damaged(path, exc, resume=False) from exc
    if "hf_config" not in common:
        raise ValueError(
            f"{path} holds no hf_config: it was not written by tandem trainer or convert"
        )
    config = json.loads(common["hf_config"])
    arch = hf_convert.arch_from_config(config, f"{path} (hf_config)")
    bf16 = is_bf16(config)  # (its config.json says what an engine loads)
    model = hf_convert.build_gpt_model(
        arch,
        uninitialized_config(arch, bf16),
        1,
        padded_vocab=int(common["padded_vocab_size"]),
    )
    say(started, f"reading {path} into a {'bf16' if bf16 else 'fp32'} {arch.model_type} model")
    try:
        load_in_place(model, path)
    except (CheckpointException, EOFError, pickle.UnpicklingError, OSError) as exc:
        raise damaged(path, exc, resume=False) from exc
    tokenizer_src = hf_dir or str(common.get("hf_source", ""))
    if not tokenizer_src or not Path(tokenizer_src).is_dir():
        print(
            f"tandem convert: warning: no tokenizer files copied: the checkpoint's source model "
            f"{tokenizer_src or '(not recorded)'} is not a directory here; pass --hf-dir "
            "with the model's tokenizer (an engine needs it)",
            file=sys.stderr,
        )
        tokenizer_src = ""
    full = {name: param.detach() for name, param in model.named_parameters()}  # (TP = 1)
    say(started, f"writing {out}")
    return write_hf_dir(
        lambda: hf_convert.megatron_full_to_hf(arch, full), common["hf_config"], out, tokenizer_src
    )


def load_in_place(model: Any, path: Path) -> None:
    """The checkpoint at `path` into `model`'s parameters. megatron loads each tensor into the
    parameter itself, but merges each SwiGLU `linear_fc1`'s gate and up halves (loaded into
    views of the parameter) into a new tensor: a copy of every fc1 at once, half the model
    again. The merge here returns the parameter when the halves are its own views."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    sharded = model.sharded_state_dict()
    for value in sharded.values():
        if isinstance(value, ShardedTensorFactory) and value.key.endswith("linear_fc1.weight"):
            value.merge_fn = _merge_in_place(value.data, value.merge_fn)
    loaded = dist_checkpointing.load(sharded, str(path))
    model.load_state_dict({key: loaded[key] for key in sharded})


def _merge_in_place(param: Any, merge: Callable) -> Callable:
    def merged(halves: list) -> Any:
        ends = [h.data_ptr() + h.numel() * h.element_size() for h in halves]
        starts = [h.data_ptr() for h in halves]
        own = [param.data_ptr(), *ends[:-1]] == starts and ends[-1] == starts[0] + param.nbytes
        return param if own else merge(halves)

    return merged


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem convert",
        description="Convert Hugging Face weights (llama, mistral, qwen2, qwen3, qwen3_moe) to a "
        "megatron dist checkpoint and back. Exit codes: 0 = written; 2 = a folder, checkpoint or "
        "flag refused (the message names it).",
    )
    sub = parser.add_subparsers(dest="direction", required=True)
    to_m = sub.add_parser("hf-to-megatron", help="HF directory -> megatron checkpoint directory")
    to_m.add_argument(
        "--hf-dir", required=True, help="HF model directory (config.json, *.safetensors)."
    )
    to_m.add_argument("--save", required=True, help="Output checkpoint directory.")
    to_m.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this (default: 128).",
    )
    to_hf = sub.add_parser("megatron-to-hf", help="megatron checkpoint directory -> HF directory")
    to_hf.add_argument(
        "--load", required=True, help="Checkpoint directory (with the tracker file)."
    )
    to_hf.add_argument("--ckpt-step", type=int, default=-1, help="Iteration (default: the latest).")
    to_hf.add_argument("--out", required=True, help="Output HF directory.")
    to_hf.add_argument(
        "--hf-dir",
        default="",
        help="HF directory to copy tokenizer files from (default: the model the checkpoint "
        "was trained from, recorded in it).",
    )
    return parser


def output_problem(args: argparse.Namespace) -> str:
    """Why the output flag cannot be written ("" when it can), before any work: a --save that
    holds a checkpoint already (its tracker would name the converted weights instead of a
    run's newest step), an --out that exists (it would be replaced, whatever it held: a folder
    of other files, the source model itself)."""
    from services.trainer.ckpt_folder import TRACKER

    if args.direction == "hf-to-megatron":
        save = Path(args.save)
        held = sorted(p.name for p in save.glob("iter_*")) if save.is_dir() else []
        if (save / TRACKER).exists() or held:
            return (
                f"--save {save}: holds a checkpoint already ({(held or [TRACKER])[0]}); give a "
                "new folder (convert does not write over a checkpoint)"
            )
        return unwritable(args.save, "--save")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"--out {out}: is a file; give a new folder"
    if out.is_dir() and any(out.iterdir()):
        return (
            f"--out {out}: exists and holds {sum(1 for _ in out.iterdir())} files; give a new "
            "folder (convert replaces nothing), or remove it first"
        )
    return unwritable(str(out.parent), f"--out {args.out}: its folder")  # (written beside it)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    made = args.direction == "hf-to-megatron" and not Path(args.save).exists()
    problem = output_problem(args)
    if problem:
        print(f"tandem convert: error: {problem}", file=sys.stderr)
        return 2
    from services.trainer.cpu_compat import import_megatron

    import_megatron()  # (first: on CPU, without compiling its kernels)
    try:
        if args.direction == "hf-to-megatron":
            path = hf_to_megatron(args.hf_dir, args.save, args.make_vocab_size_divisible_by)
        else:
            path = megatron_to_hf(args.load, args.out, args.ckpt_step, args.hf_dir)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # (no quotes)
        print(f"tandem convert: error: {text}", file=sys.stderr)
        if made:  # (a --save this run made holds no checkpoint: none is left that looks one)
            shutil.rmtree(args.save, ignore_errors=True)
        return 2
    print(f"tandem convert: wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
