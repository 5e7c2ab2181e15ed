"""A reader of the TensorBoard event files `tandem/tensorboard.py` writes: every record's CRCs
checked, every scalar returned (the format is in that module's docstring)."""

from __future__ import annotations

import struct
from pathlib import Path

from tandem.tensorboard import masked_crc


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _fields(data: bytes) -> list[tuple[int, int | float | bytes]]:
    """(number, value) of a protobuf message's wire fields (varint, 64-bit, bytes, 32-bit)."""
    out: list[tuple[int, int | float | bytes]] = []
    i = 0
    while i < len(data):
        key, i = _read_varint(data, i)
        number, wire = key >> 3, key & 7
        value: int | float | bytes
        if wire == 0:
            value, i = _read_varint(data, i)
        elif wire == 1:
            value, i = struct.unpack_from("<d", data, i)[0], i + 8
        elif wire == 2:
            size, i = _read_varint(data, i)
            value, i = data[i : i + size], i + size
        elif wire == 5:
            value, i = struct.unpack_from("<f", data, i)[0], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((number, value))
    return out


def read_scalars(path: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in an event file; checks every CRC."""
    data, i, out = path.read_bytes(), 0, []
    while i < len(data):
        header = data[i : i + 8]
        (size,) = struct.unpack("<Q", header)
        if struct.unpack_from("<I", data, i + 8)[0] != masked_crc(header):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        body = data[i + 12 : i + 12 + size]
        if struct.unpack_from("<I", data, i + 12 + size)[0] != masked_crc(body):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        i += 16 + size
        event = _fields(body)
        step = next((int(v) for n, v in event if n == 2 and isinstance(v, int)), 0)
        for number, summary in event:
            if number != 5 or not isinstance(summary, bytes):
                continue
            for _, value in _fields(summary):
                parts = dict(_fields(value))  # type: ignore[arg-type]
                out.append((step, parts[1].decode(), float(parts[2])))  # type: ignore[union-attr, arg-type]
    return out
