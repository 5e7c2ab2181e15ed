"""ReadAhead: a consumer's reads of new entries, the next one under way while the last is used.

The trainer's intake reads entries, then decodes and checks their groups. A read is a round trip
in which the server builds a reply of up to an entry's megabyte and the kernel copies it into
the socket, time the reader spends waiting (the copy runs with the GIL released). `read` returns
the reply of the read it started at its previous call when there is one (else it reads now), and
when that reply held entries, starts the next read in a thread of its own, so decoding one
reply overlaps the reading of the next (bench/buffer_throughput.py measures both ways).

Bounds: one read in flight, of at most `count` entries (the count of the call that started
it), so at most one read's entries are held beyond what the caller asked for. Entries a read
returned are delivered to the consumer (pending in its consumer group until acked): a reader
that dies or stops holding them loses nothing, its next start reads its pending entries
first, as it reads any entry it read and did not ack. A read that failed raises its error
from the `read` that takes its reply, in the caller's thread, where it is handled as any read's.

Waits for: the read in flight (at most its `block_ms`, or the client's socket timeout when the
server stops answering). The thread is a daemon: a process that exits does not wait for it.
"""

from __future__ import annotations

import queue
import threading

from services.sample_buffer.buffer import Entry, SampleBuffer


class ReadAhead:
    """New entries (`>`) of one consumer, read one read ahead."""

    def __init__(self, buffer: SampleBuffer, consumer: str) -> None:
        self.buffer, self.consumer = buffer, consumer
        # (each holds at most one item: one read asked for, one reply not yet taken)
        self._asks: queue.Queue[tuple[int, int]] = queue.Queue(maxsize=1)
        self._replies: queue.Queue[list[Entry] | BaseException] = queue.Queue(maxsize=1)
        self._in_flight = False
        self._thread: threading.Thread | None = None

    def read(self, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` new entries, waiting at most `block_ms` for one (the read started
        before, whatever its count, when there is one); then the next read starts, when this
        one found entries."""
        if self._in_flight:
            self._in_flight = False
            reply = self._replies.get()
            if isinstance(reply, BaseException):
                raise reply
            entries = reply
        else:
            entries = self.buffer.read_entries(self.consumer, count, ">", block_ms)
        if entries:
            self._start(count, block_ms)
        return entries

    def _start(self, count: int, block_ms: int) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="read-ahead", daemon=True)
            self._thread.start()
        self._asks.put((count, block_ms))
        self._in_flight = True

    def _serve(self) -> None:
        while True:
            count, block_ms = self._asks.get()
            try:
                reply: list[Entry] | BaseException = self.buffer.read_entries(
                    self.consumer, count, ">", block_ms
                )
            except BaseException as exc:  # (re-raised in the caller's thread by `read`)
                reply = exc
            self._replies.put(reply)
