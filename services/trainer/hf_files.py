"""Safetensors files read and written one tensor at a time, so a conversion holds the model once.

Knows: the safetensors layout (an 8-byte little-endian header size, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes); which files of a HF folder hold its weights
(`services.common.hf_weights.weight_files`). Reads use plain file reads into a tensor of the
caller's (no memory map: mapped pages of a read file count in the process's RSS until it ends),
and check each file's header against its size, so a shard cut short is named, not a traceback.

Does not know model architectures (`hf_arch`) or how HF names map to megatron's (`hf_convert`).
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from pathlib import Path
from typing import NamedTuple

import torch

from services.common.hf_weights import weight_files

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
CUT_SHORT = "a download cut short? download the model again"


class Entry(NamedTuple):
    """Where one tensor lies: its file, dtype, shape and byte range in the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(file: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file; ValueError naming the file when its header is not
    one or does not match the file's size (a file cut short)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(f"{file}: not a safetensors file ({size} bytes): {CUT_SHORT}")
        try:
            header = json.loads(f.read(length))
            entries = {
                name: _entry(file, 8 + length, info)
                for name, info in header.items()
                if name != "__metadata__"
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{file}: not a safetensors header ({exc!r}): {CUT_SHORT}") from None
    wanted = max((e.end for e in entries.values()), default=8 + length)
    if wanted != size:
        raise ValueError(f"{file} holds {size} bytes, its header says {wanted}: {CUT_SHORT}")
    return entries


def _entry(file: Path, base: int, info: dict) -> Entry:
    start, end = (int(x) for x in info["data_offsets"])
    dtype, shape = DTYPES[info["dtype"]], tuple(int(n) for n in info["shape"])
    if end - start != torch.Size(shape).numel() * dtype.itemsize or start < 0:
        raise ValueError(f"offsets {start}..{end} do not hold {info['dtype']} {list(shape)}")
    return Entry(file, dtype, shape, base + start, base + end)


class HfState(MutableMapping[str, torch.Tensor]):
    """The tensors of a HF folder's safetensors weight files by name, each read from its file
    when looked up (a fresh tensor each time); a tensor set here (`state[name] = t`) is held."""

    def __init__(self, model_dir: str | Path, flag: str = "--model") -> None:
        files = [f for f in weight_files(model_dir) if f.suffix == ".safetensors"]
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors in {model_dir}: {flag} needs HF safetensors weights"
            )
        self.folder = Path(model_dir)
        self.entries: dict[str, Entry] = {}
        for file in files:
            self.entries.update(read_header(file))
        self.held: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.held:
            return self.held[name]
        entry = self.entries.get(name)
        if entry is None:
            raise KeyError(
                f"{self.folder} holds no tensor {name} (in none of its weight files): are its "
                f"config.json and weights of one model? {CUT_SHORT}"
            )
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor, first_row: int = 0) -> None:
        """Tensor `name`'s bytes from row `first_row` on into `out` (contiguous, of its dtype,
        as many elements as it holds)."""
        entry = self.entries[name]
        row = torch.Size(entry.shape[1:]).numel() * entry.dtype.itemsize
        start = entry.start + first_row * row
        if not out.is_contiguous() or out.dtype != entry.dtype or out.device.type != "cpu":
            raise ValueError(f"read_into {name}: a contiguous {entry.dtype} CPU tensor is needed")
        if start + out.numel() * entry.dtype.itemsize > entry.end:
            raise ValueError(f"{entry.file}: {name} is {list(entry.shape)}, not {list(out.shape)}")
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(entry.file, "rb") as f:
            f.seek(start)
            done = 0
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(f"{entry.file}: {name} is cut short: {CUT_SHORT}")
                done += got

    def __contains__(self, name: object) -> bool:
        return name in self.held or name in self.entries

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self.held[name] = tensor

    def __delitem__(self, name: str) -> None:
        self.held.pop(name, None)
        self.entries.pop(name)

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self.entries), **dict.fromkeys(self.held)})

    def __len__(self) -> int:
        return len(set(self.entries) | set(self.held))


def write_safetensors(
    folder: Path,
    tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    dtype: torch.dtype | None,
    max_shard_bytes: int,
) -> list[str]:
    """The tensors `tensors()` yields as safetensors files in `folder`, floating ones in `dtype`
    (None = as they are); the file names. Up to `max_shard_bytes` of tensors a file, as HF
    writes a model: one file is `model.safetensors`, more are `model-0000i-of-0000n.safetensors`
    with `model.safetensors.index.json` naming each tensor's file (a 64 GB file is refused by
    the Hub). `tensors` is called twice (the headers first, then the bytes, each tensor at its
    offset as it comes), so it may yield views or copies made one at a time: the memory of one
    tensor, not of the model. A file's layout is safetensors' own (tensors by alignment then
    name, the header padded to 8 bytes): each is the file `safetensors.torch.save_file` writes
    of its tensors."""

    def final(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    kinds = {name: (final(t), list(t.shape), t.numel()) for name, t in tensors()}
    files, where, heads = _layout(kinds, max_shard_bytes)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(open(folder / file, "wb")) for file in files]
        for f, text in zip(handles, heads, strict=True):
            f.write(struct.pack("<Q", len(text)) + text)
        for name, t in tensors():
            if (final(t), list(t.shape)) != kinds[name][:2]:
                raise RuntimeError(f"{name} changed between the two passes of write_safetensors")
            index, offset = where[name]
            handles[index].seek(8 + len(heads[index]) + offset)
            data = t.detach().to("cpu", final(t)).contiguous()
            handles[index].write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
    if len(files) > 1:
        total = sum(numel * kind.itemsize for kind, _shape, numel in kinds.values())
        weight_map = {name: files[where[name][0]] for name in sorted(kinds)}
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    return files


Kinds = dict[str, tuple[torch.dtype, list[int], int]]  # name -> (dtype written, shape, numel)


def _layout(
    kinds: Kinds, max_shard_bytes: int
) -> tuple[list[str], dict[str, tuple[int, int]], list[bytes]]:
    """The files' names, each tensor's (file index, offset of its bytes) and each file's
    padded header: tensors in the order they come, a new file when the next would pass
    `max_shard_bytes` (as HF shards)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (kind, _shape, numel) in kinds.items():
        if shards[-1] and size + numel * kind.itemsize > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += numel * kind.itemsize
    n = len(shards)
    files = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    where: dict[str, tuple[int, int]] = {}
    heads = []
    for index, names in enumerate(shards):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in sorted(names, key=lambda n: (-kinds[n][0].itemsize, n)):
            kind, shape, numel = kinds[name]
            end = offset + numel * kind.itemsize
            header[name] = {"dtype": NAMES[kind], "shape": shape, "data_offsets": [offset, end]}
            where[name], offset = (index, offset), end
        text = json.dumps(header, separators=(",", ":")).encode()
        heads.append(text + b" " * (-len(text) % 8))
    return (["model.safetensors"] if n == 1 else files), where, heads
