"""What the trainer tells an operator besides its status: the `train/*` metrics record and
stdout line of each step, `GET /metrics` (Prometheus text, `--metrics-port`), and timeline spans
(waits for data, and each step with its phases: recompute, forward/backward, optimizer, publish).

The metrics server answers from a daemon thread and reads only numbers this module keeps, so a
scrape never waits for or slows a training step; spans go to the timeline's background writer.
Rank 0 only talks to Redis and serves; every rank keeps the same clock (it costs nothing).
"""

from __future__ import annotations

import math
import time

from services.common.metrics import Metrics, gauge, serve_metrics
from services.sample_buffer import SampleBuffer
from services.sample_buffer.timeline import Timeline
from services.trainer.config import TrainerConfig
from services.trainer.rollout import Rollout

# Last-step values exposed as gauges: metric key -> (Prometheus name, help). Prometheus names
# spell units out (`_seconds`, `_per_second`): promtool's lint refuses abbreviations (`_s`).
STEP_GAUGES = {
    "train/loss": ("loss", "Policy loss of the last step."),
    "train/reward_mean": ("reward_mean", "Mean reward of the last step's samples."),
    "train/grad_norm": ("grad_norm", "Gradient norm of the last step (before clipping)."),
    "train/staleness_mean": ("staleness_mean", "Mean version lag of the last step's samples."),
    "train/tokens_per_s": (
        "tokens_per_second",
        "Tokens trained per second in the last step (train/tokens_per_s).",
    ),
    "train/step_time_s": ("last_step_seconds", "Wall time of the last step (update + publish)."),
}


class StepClock:
    """Wall-clock marks of one step; each mark ends the phase named by it."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = [("", time.time())]

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.time()))

    def phases(self) -> list[tuple[str, float, float]]:
        return [
            (name, start, end)
            for (_, start), (name, end) in zip(self.marks, self.marks[1:], strict=False)
        ]

    def seconds(self, *names: str) -> float:
        return sum(end - start for name, start, end in self.phases() if name in names)


class TrainerObserver:
    def __init__(self, cfg: TrainerConfig, buffer: SampleBuffer | None) -> None:
        self.buffer = buffer
        self.clock = StepClock()
        self.started = time.time()
        self.version = 0
        self.last: dict[str, float] = {}
        self.metrics = Metrics("tandem_trainer_")
        self.metrics.counter("steps", "Optimizer steps done by this process.")
        self.metrics.counter("samples_trained", "Samples trained on.")
        self.metrics.counter("tokens_trained", "Tokens trained on.")
        self.metrics.counter("wait_seconds", "Seconds spent waiting for sample groups.")
        self.step_seconds = self.metrics.histogram("step_seconds", "Wall time of each step.")
        self.timeline = Timeline(buffer.redis, cfg.run.run_id, "trainer") if buffer else None
        self.server = None
        self.url = ""
        if buffer is not None and cfg.metrics_port >= 0:
            self.server = serve_metrics(cfg.metrics_host, cfg.metrics_port, self.render)
            self.url = f"http://{cfg.metrics_host}:{self.server.server_address[1]}/metrics"
            print(f"[trainer] Prometheus metrics at {self.url}", flush=True)

    def mark(self, phase: str) -> None:
        """End the current step's `phase` now (called from inside the step)."""
        self.clock.mark(phase)

    def waited(self, since: float, version: int) -> None:
        """The trainer waited for sample groups from `since` until now."""
        now = time.time()
        self.metrics.inc("wait_seconds", now - since)
        if self.timeline is not None:
            self.timeline.add("wait for data", since, now, "steps", next_step=version + 1)
        self.clock = StepClock()

    def step_done(self, version: int, metrics: dict[str, float], rollout: Rollout) -> None:
        """Timing metrics into `metrics`; then the step's record, line, counters and spans."""
        clock = self.clock
        metrics["train/update_time_s"] = clock.seconds("recompute", "forward_backward", "optimizer")
        metrics["train/publish_time_s"] = clock.seconds("publish")  # export + send to engines
        metrics["train/step_time_s"] = step_s = clock.seconds(*(n for n, _, _ in clock.phases()))
        metrics["train/tokens_per_s"] = metrics.get("train/tokens", 0.0) / max(step_s, 1e-9)
        metrics["train/dropped_stale"] = float(rollout.dropped_stale)
        for age, n in sorted(rollout.staleness_counts.items()):
            metrics[f"train/staleness_hist/{age}"] = float(n)
        self.clock = StepClock()  # the next step of the same rollout starts now
        if self.buffer is None:
            return
        self.buffer.publish_metrics("trainer", version, metrics, once_per_step=True)
        self.version, self.last = version, metrics
        self.metrics.inc("steps")
        self.metrics.inc("samples_trained", metrics.get("train/samples", 0.0))
        self.metrics.inc("tokens_trained", metrics.get("train/tokens", 0.0))
        self.step_seconds.observe(step_s)
        if self.timeline is not None:
            start, end = clock.marks[0][1], clock.marks[-1][1]
            self.timeline.add(f"step {version}", start, end, "steps", loss=metrics["train/loss"])
            for name, s, e in clock.phases():
                self.timeline.add(name, s, e, "phases", step=version)
        print_step(version, metrics)

    def render(self) -> str:
        wall = max(time.time() - self.started, 1e-9)
        waited = self.metrics.counters["wait_seconds"].get((), 0.0)
        gauges = [
            gauge("version", "Weight version of the trainer (optimizer steps done).", self.version),
            gauge(
                "idle_fraction",
                "Share of the trainer's time spent waiting for sample groups.",
                min(waited / wall, 1.0),
            ),
        ]
        for key, (name, help_text) in STEP_GAUGES.items():
            gauges.append(gauge(name, help_text, self.last.get(key, math.nan)))
        return self.metrics.render(gauges)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None


def print_step(version: int, m: dict[str, float]) -> None:
    print(
        f"[trainer] step {version} loss {m['train/loss']:.4f} "
        f"reward {m['train/reward_mean']:.3f} stale {m['train/staleness_mean']:.2f}/"
        f"{m['train/staleness_max']:.0f} lp_diff {m['train/logprob_abs_diff_max']:.1e} "
        f"grad {m['train/grad_norm']:.3f} samples {m['train/samples']:.0f} "
        f"tokens {m['train/tokens']:.0f} dropped {m['train/dropped_stale']:.0f} "
        f"{m['train/step_time_s']:.2f}s",
        flush=True,
    )
