"""ReadAhead: a consumer's reads of new entries, the next one sent while the last is used.

The trainer's intake reads entries, then decodes and checks their groups. A read is a round trip
in which the server finds the entries and writes a reply of up to an entry's megabyte, time the
reader would spend waiting. `read` takes the reply of the read it sent at its previous call when
there is one (else it reads now), and when that reply held entries sends the next read on a
connection of its own without waiting for it: the server answers it while the caller decodes,
and the reply waits in the socket until the next `read` takes it (bench/buffer_throughput.py
measures both ways). A pipelined command, not a thread: a reading thread contended for the GIL
with the decoding, and cost more CPU than the wait it hid on a 2-core machine.

Bounds: one read in flight, of at most `count` entries (the count of the call that sent it), so
at most one read's entries are held beyond what the caller asked for. Entries a read returned
are delivered to the consumer (pending in its consumer group until acked): a reader that stops
with a read in flight loses nothing, its next start reads its pending entries first, as it
reads any entry it read and did not ack. A read in flight whose connection failed is made
again by the client (its retries, as any read); one the server refused raises as any read's.

Waits for: the reply of the read in flight (at most its `block_ms` after it was sent, or the
client's socket timeout when the server stops answering).
"""

from __future__ import annotations

import gc

import redis

from services.sample_buffer.buffer import Entry, SampleBuffer
from services.sample_buffer.keys import CONSUMER_GROUP

# A group read decodes into ~20 containers the collector tracks (its lists of token ids,
# log-probs and masks), alive until the reader is done with its batch. At the collector's
# default threshold (700 new containers) a young collection runs every ~35 groups and promotes
# the groups in hand, and the full collections that follow traverse the reader's whole heap
# (torch's included): in the trainer that doubled the CPU time of a read. Decoded groups hold
# no reference cycles (refcounting frees them), so collecting less often keeps nothing longer.
GC_GEN0_THRESHOLD = 50_000


def tune_gc_for_reads() -> None:
    """For a process that reads many groups (the trainer), once set up: freeze what it holds
    now (no full collection traverses it again) and run young collections every
    `GC_GEN0_THRESHOLD` new containers."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


class ReadAhead:
    """New entries (`>`) of one consumer, read one read ahead."""

    def __init__(self, buffer: SampleBuffer, consumer: str) -> None:
        self.buffer, self.consumer = buffer, consumer
        self._sent: redis.connection.AbstractConnection | None = None  # the read in flight's

    def read(self, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` new entries, waiting at most `block_ms` for one (the read sent before,
        whatever its count, when there is one); then the next read is sent, when this one
        found entries."""
        entries = self._take() if self._sent is not None else None
        if entries is None:
            entries = self.buffer.read_entries(self.consumer, count, ">", block_ms)
        if entries:
            self._send(count, block_ms)
        return entries

    def _send(self, count: int, block_ms: int) -> None:
        pool = self.buffer.redis.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_command(
                "XREADGROUP",
                *("GROUP", CONSUMER_GROUP, self.consumer, "COUNT", count, "BLOCK", block_ms),
                *("STREAMS", self.buffer.samples_key, ">"),
            )
        except (redis.ConnectionError, redis.TimeoutError):  # (the next read is made as any)
            connection.disconnect()
            pool.release(connection)
            return
        self._sent = connection

    def _take(self) -> list[Entry] | None:
        """The reply of the read in flight; None when its connection failed."""
        connection, self._sent = self._sent, None
        assert connection is not None
        pool = self.buffer.redis.connection_pool
        try:
            reply = connection.read_response()
        except redis.ResponseError as exc:
            return self.buffer.read_refused(exc)
        except (redis.ConnectionError, redis.TimeoutError):
            connection.disconnect()
            return None
        finally:
            pool.release(connection)
        parse = self.buffer.redis.response_callbacks["XREADGROUP"]
        return self.buffer.entries_of(parse(reply))
