"""Prometheus text exposition (format 0.0.4) without a client library, and a tiny HTTP server.

A service keeps a `Metrics` registry: counters and histograms it updates as work happens, and
gauges it sets when scraped (`Metrics.render(gauges)`), so a scrape reads the service's state
instead of a copy that could go stale. Names follow Prometheus conventions: `tandem_<service>_`,
base units (`_seconds`, `_bytes`), `_total` for counters. `serve_metrics` answers `GET /metrics`
from a daemon thread for a process without an HTTP server of its own (the trainer).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from services.common.serving import bind_socket

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets (seconds) from a cache hit to a long generation or a large weight sync.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

Labels = tuple[tuple[str, str], ...]
# One gauge as the service reads it when scraped: (name, help, {labels: value}).
Gauge = tuple[str, str, dict[Labels, float]]


def labels(**pairs: object) -> Labels:
    return tuple((k, str(v)) for k, v in sorted(pairs.items()))


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if value != int(value) else str(int(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, pairs: Labels, value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return f"{name}{{{inner}}} {_number(value)}" if inner else f"{name} {_number(value)}"


class Histogram:
    """Cumulative buckets, sum and count of observed values (thread-safe)."""

    def __init__(self, buckets: Iterable[float] = SECONDS_BUCKETS) -> None:
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.sum += value
            self.counts[bisect.bisect_left(self.bounds, value)] += 1

    def lines(self, name: str) -> list[str]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        out, running = [], 0
        for bound, n in zip([*self.bounds, math.inf], counts, strict=True):
            running += n
            out.append(_sample(f"{name}_bucket", (("le", _number(bound)),), running))
        return [*out, _sample(f"{name}_sum", (), total), _sample(f"{name}_count", (), running)]


class Metrics:
    """Counters (by name and labels) and histograms of one service, rendered with its gauges."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.help: dict[str, str] = {}
        self.counters: dict[str, dict[Labels, float]] = {}
        self.histograms: dict[str, Histogram] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, help_text: str, labelled: bool = False) -> None:
        """Declare a counter (`name` without the `_total` suffix); an unlabelled one renders
        0 before its first `inc`, so a scraper sees the series from the start."""
        self.help[name] = help_text
        self.counters.setdefault(name, {} if labelled else {(): 0.0})

    def inc(self, name: str, amount: float = 1.0, pairs: Labels = ()) -> None:
        with self._lock:
            series = self.counters.setdefault(name, {})
            series[pairs] = series.get(pairs, 0.0) + amount

    def histogram(
        self, name: str, help_text: str, buckets: Iterable[float] = SECONDS_BUCKETS
    ) -> Histogram:
        self.help[name] = help_text
        return self.histograms.setdefault(name, Histogram(buckets))

    def render(self, gauges: Iterable[Gauge] = (), totals: Iterable[Gauge] = ()) -> str:
        """The exposition text: the registry's counters and histograms, then `gauges` and
        `totals` (counters kept elsewhere, e.g. in Redis, read at scrape time)."""
        lines: list[str] = []
        with self._lock:
            counters = [(n, self.help.get(n, n), dict(s)) for n, s in self.counters.items()]
        for name, help_text, series in [*counters, *totals]:
            full = f"{self.prefix}{name}_total"
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter"]
            lines += [_sample(full, pairs, value) for pairs, value in sorted(series.items())]
        for name, hist in self.histograms.items():
            full = self.prefix + name
            lines += [f"# HELP {full} {self.help[name]}", f"# TYPE {full} histogram"]
            lines += hist.lines(full)
        for name, help_text, series in gauges:
            full = self.prefix + name
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} gauge"]
            lines += [_sample(full, pairs, value) for pairs, value in sorted(series.items())]
        return "\n".join(lines) + "\n"


def gauge(name: str, help_text: str, value: float) -> Gauge:
    """A gauge with one unlabelled value."""
    return name, help_text, {(): float(value)}


def serve_metrics(host: str, port: int, render: Callable[[], str]) -> ThreadingHTTPServer:
    """Answer `GET /metrics` with `render()` from a daemon thread; returns the bound server
    (port 0 picks a free one: read `server.server_address`). A failing `render` is a 500; a
    port or host it cannot listen on is `serving.ListenError` naming --metrics-port/-host."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            try:
                body, status = render().encode(), 200
            except Exception as exc:  # a scrape must not kill the thread; the scraper sees it
                body, status = f"metrics failed: {exc!r}\n".encode(), 500
            self.send_response(status)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # scrapes every few seconds: no log
            pass

    server = ThreadingHTTPServer((host, port), Handler, bind_and_activate=False)
    server.socket.close()  # (a taken port was an OSError's traceback: named as the flag now)
    server.socket = bind_socket(host, port, "--metrics-port", "--metrics-host")
    server.server_name, server.server_port = server.socket.getsockname()[:2]
    server.server_address = (server.server_name, server.server_port)
    server.server_activate()
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
