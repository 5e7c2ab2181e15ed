"""The engine's `GET /metrics` (Prometheus text): requests, tokens, running and queued
sequences, the served weight version, and a latency histogram of `/generate` requests.

Counters live here and are fed by `Engine.generate` (one call per request, after it finished);
the scheduler's numbers are read when scraped (its lock is held only to count).
"""

from __future__ import annotations

from services.common.metrics import Metrics, gauge
from services.engine.scheduler import Scheduler


class EngineMetrics:
    def __init__(self) -> None:
        self.metrics = Metrics("tandem_engine_")
        self.metrics.counter("requests", "Generate requests answered (native, OpenAI, streamed).")
        self.generate_seconds = self.metrics.histogram(
            "generate_seconds", "Time from a generate request's submit to its last token."
        )

    def request_done(self, seconds: float) -> None:
        self.metrics.inc("requests")
        self.generate_seconds.observe(seconds)

    def render(self, scheduler: Scheduler) -> str:
        """The text of `GET /metrics`, the scheduler's numbers read now."""
        load, stats = scheduler.load(), scheduler.stats
        totals = [
            gauge(name, text, stats[name])
            for name, text in (
                ("generated_tokens", "Tokens generated (sampled) by this engine."),
                ("forward_passes", "Model forward passes (prefill and decode)."),
            )
        ]
        gauges = [
            gauge("running_sequences", "Sequences in the running batch.", load["num_running_reqs"]),
            gauge(
                "queued_sequences", "Sequences waiting for a batch slot.", load["num_waiting_reqs"]
            ),
            gauge(
                "running_tokens",
                "Tokens (prompt + output) of the running batch.",
                load["num_tokens"],
            ),
            gauge("paused", "1 while generation is paused.", load["paused"]),
            gauge("weight_version", "Weight version served.", scheduler.weight_version),
        ]
        return self.metrics.render(gauges, totals)
