"""A version's buckets as one safetensors file, without torch (the broker's disk transport
writes it for engines that reload from disk, as SGLang's `/update_weights_from_disk`)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from proto import TensorMeta, WeightBucketHeader, decode
from services.weight_sync.wire import frame_view

# dtype name on the wire -> (safetensors code, bytes per element)
DTYPES = {
    "float32": ("F32", 4),
    "bfloat16": ("BF16", 2),
    "float16": ("F16", 2),
    "float64": ("F64", 8),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}


def tensors_nbytes(tensors: list[TensorMeta]) -> int:
    """Bytes of the tensors a bucket lists (shared-memory buckets carry no frames to count)."""
    total = 0
    for meta in tensors:
        count = 1
        for dim in meta.shape:
            count *= dim
        total += count * DTYPES.get(meta.dtype, ("", 4))[1]
    return total


def write_safetensors(path: Path, messages: list[list]) -> int:
    """Write every tensor of a version's buckets (frames messages) as one safetensors file;
    returns the tensor bytes written."""
    header: dict[str, dict] = {}
    frames = []
    offset = 0
    for message in messages:
        bucket = decode(bytes(frame_view(message[0])), WeightBucketHeader)
        for meta, frame in zip(bucket.tensors, message[1:], strict=True):
            view = frame_view(frame)
            if meta.dtype not in DTYPES:
                raise ValueError(f"cannot write dtype {meta.dtype} of {meta.name} to safetensors")
            header[meta.name] = {
                "dtype": DTYPES[meta.dtype][0],
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
