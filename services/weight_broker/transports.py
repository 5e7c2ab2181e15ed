"""How the broker gets a complete version into one engine: the `WeightTransport` seam.

- `ZmqTransport`: the engine fetches the buckets from the broker's ROUTER socket
  (`POST /update_weights_from_zmq`, Tandem's reference engine).
- `DiskTransport`: the broker writes the version once as a Hugging Face directory
  (`model.safetensors` plus the non-weight files of `--model-dir`) under `--disk-dir`, then each
  engine reloads it (`POST /update_weights_from_disk`, which real SGLang servers implement). The
  directory must be visible to the engines (same host or a shared volume).

`prepare` runs once per version, `update` once per engine; `update` raises `RuntimeError` with
the engine's message when the engine refuses.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Protocol

import aiohttp

from proto import WeightBucketHeader, decode
from services.weight_broker.store import Version
from services.weight_sync.wire import frame_view

SAFETENSORS_DTYPES = {
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


class WeightTransport(Protocol):
    def prepare(self, version: Version) -> None: ...

    async def update(self, session: aiohttp.ClientSession, url: str, version: int) -> None: ...


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with session.post(url, json=body) as resp:
        reply = await resp.json(content_type=None)
        if resp.status != 200 or not reply.get("success", False):
            raise RuntimeError(f"HTTP {resp.status}: {reply.get('message', reply)}")


class ZmqTransport:
    def __init__(self, serve_endpoint: str) -> None:
        self.serve_endpoint = serve_endpoint

    def prepare(self, version: Version) -> None:
        """Nothing to do: the broker already holds the buckets the engines will fetch."""

    async def update(self, session: aiohttp.ClientSession, url: str, version: int) -> None:
        body = {
            "endpoint": self.serve_endpoint,
            "weight_version": str(version),
            "flush_cache": True,
        }
        await _post(session, f"{url}/update_weights_from_zmq", body)


class DiskTransport:
    def __init__(self, disk_dir: str, model_dir: str, keep_versions: int = 2) -> None:
        if not disk_dir:
            raise ValueError("--transport disk needs --disk-dir (a folder the engines can read)")
        if not model_dir or not (Path(model_dir) / "config.json").exists():
            raise ValueError(
                "--transport disk needs --model-dir, a HF directory with config.json whose "
                "tokenizer and config files are copied next to each version's weights"
            )
        self.root = Path(disk_dir)
        self.model_dir = Path(model_dir)
        self.keep_versions = keep_versions

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version}"

    def prepare(self, version: Version) -> None:
        target = self.version_dir(version.version)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weight_files = (".safetensors", ".bin", ".pt")
        for item in self.model_dir.iterdir():
            if item.is_file() and not item.name.endswith((*weight_files, ".index.json")):
                shutil.copy2(item, tmp / item.name)
        write_safetensors(tmp / "model.safetensors", version.messages())
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # engines only ever see complete directories
        for old in self.root.glob("v*"):
            number = old.name[1:]
            if number.isdigit() and int(number) <= version.version - self.keep_versions:
                shutil.rmtree(old, ignore_errors=True)

    async def update(self, session: aiohttp.ClientSession, url: str, version: int) -> None:
        body = {"model_path": str(self.version_dir(version)), "weight_version": str(version)}
        await _post(session, f"{url}/update_weights_from_disk", body)


def write_safetensors(path: Path, messages: list[list]) -> int:
    """Write every tensor of a version's buckets as one safetensors file (no torch needed)."""
    header: dict[str, dict] = {}
    frames = []
    offset = 0
    for message in messages:
        bucket = decode(bytes(frame_view(message[0])), WeightBucketHeader)
        for meta, frame in zip(bucket.tensors, message[1:], strict=True):
            view = frame_view(frame)
            if meta.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"cannot write dtype {meta.dtype} of {meta.name} to safetensors")
            header[meta.name] = {
                "dtype": SAFETENSORS_DTYPES[meta.dtype],
                "shape": meta.shape,
                "data_offsets": [offset, offset + view.nbytes],
            }
            frames.append(view)
            offset += view.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for view in frames:
            out.write(view)
    return offset
