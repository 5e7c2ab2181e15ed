"""TensorBoard scalars without TensorBoard: a writer of TFRecord event files (what
`tf.summary` and `torch.utils.tensorboard` write), so every run folder can be opened with
`tensorboard --logdir RUN_DIR/tensorboard` while Tandem needs neither TensorFlow nor protobuf.

The format, byte for byte: each record is `uint64 length, uint32 masked_crc32c(length), data,
uint32 masked_crc32c(data)` (little-endian); each data is an `Event` protobuf: wall_time
(field 1, double), step (2, varint), file_version (3, string, the first event only) or summary
(5: repeated Value {tag (1, string), simple_value (2, float)}). The tests read it back
(tests/tensorboard_events.py).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import BinaryIO

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 as protobuf writes it (ten bytes)
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + body


class EventWriter:
    """One `events.out.tfevents.*` file in `log_dir`; `add_scalars` appends one event. The
    folder and the file are made with the first scalar: a run refused at its start (a resume
    too) left a file of no scalar, which TensorBoard lists as a run."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.file: BinaryIO | None = None

    def add_scalars(self, step: int, values: dict[str, float], wall_time: float) -> None:
        summary = b"".join(
            _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", float(value)))
            for tag, value in values.items()
        )
        if not summary:
            return
        if self.file is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.tandem"
            self.file = open(self.log_dir / name, "ab")  # noqa: SIM115 - closed in close()
            self._write(_event(time.time(), 0, _field(3, b"brain.Event:2")))
        self._write(_event(wall_time, step, _field(5, summary)))

    def _write(self, data: bytes) -> None:
        assert self.file is not None
        header = struct.pack("<Q", len(data))
        self.file.write(header + struct.pack("<I", masked_crc(header)))
        self.file.write(data + struct.pack("<I", masked_crc(data)))

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
