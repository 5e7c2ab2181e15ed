"""A chunked request body over a service's `--max-request-bytes` is answered 413 every time, the
answer readable by the client, not a connection reset (the broker as a process, a raw socket as
the client, so nothing between them retries or buffers)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

CAP = 4096
CHUNK = b"x" * 8192


def post_chunked(url: str, chunks: int) -> bytes:
    """POST /engines with a chunked body of `chunks` chunks; the raw answer (up to its end)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        head = (
            f"POST /engines HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        for _ in range(chunks):
            sock.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
        sock.sendall(b"0\r\n\r\n")
        answer = b""
        while data := sock.recv(65536):
            answer += data
        return answer


def test_a_chunked_body_over_the_cap_is_answered_413_every_time(start_service) -> None:  # type: ignore[no-untyped-def]
    broker = start_service("broker", ["broker", "--port", "0", "--max-request-bytes", str(CAP)])
    outcomes = []
    for _ in range(20):
        try:
            answer = post_chunked(broker.url, chunks=32)  # 256 KiB, 64 times the cap
            outcomes.append(answer.split(b"\r\n", 1)[0].decode())
            assert b"--max-request-bytes" in answer, answer
        except ConnectionError as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes == ["HTTP/1.1 413 Request Entity Too Large"] * 20, outcomes
    # A chunked body within the cap still reaches the route (422: not a registration).
    assert post_chunked(broker.url, chunks=0).startswith(b"HTTP/1.1 422")
