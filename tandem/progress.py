"""Progress of a run: metrics records in, console lines, `metrics.jsonl` and a PNG plot out."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from proto import MetricsRecord

NO_SIGNAL_STEPS = 20  # steps in a row without a group that tells responses apart, then said
# Trainer/engine log-prob max abs diff on same-version samples past which the run is told: fp32
# on both sides agrees to ~1e-6 (the tests' bound is 1e-3); bf16 on one side moves the worst
# token's more (so the warning names dtype among the causes); a temperature or weights the
# trainer does not see give 0.1-1 (0.498 at temperature 0.7 on the toy task).
LOGPROB_DIFF_WARN = 0.1
# metrics.png's panels: title, then (source, metric key, label) of each curve in it.
PANELS = [
    (
        "reward (mean)",
        [("trainer", "train/reward_mean", "trained"), ("router", "rollout/reward_mean", "rollout")],
    ),
    ("held-out greedy accuracy", [("router", "eval/accuracy", "held-out accuracy")]),
    ("policy loss", [("trainer", "train/loss", "loss")]),
    (
        "trainer/engine log-prob mismatch",
        [
            ("trainer", "train/logprob_abs_diff_max", "max abs diff"),
            ("trainer", "train/mismatch_kl", "KL"),
        ],
    ),
    (
        "throughput",
        [
            ("router", "rollout/samples_per_s", "rollout samples/s"),
            ("trainer", "train/tokens_per_s", "trained tokens/s"),
        ],
    ),
]


def mismatch_warning(diff: float, what: str) -> str:
    """The console's warning about a trainer/engine log-prob max abs diff `diff` of `what`
    ("" when under LOGPROB_DIFF_WARN or NaN)."""
    if not diff > LOGPROB_DIFF_WARN:
        return ""
    return (
        f"[up] warning: the trainer's log-probs differ from the engines' by up to {diff:.3f} "
        f"on {what} (more than {LOGPROB_DIFF_WARN}): the trainer is not scoring the "
        "distribution the engines sampled, so its off-policy correction is wrong. Likely "
        "causes: sampling the trainer does not apply (a router or samples without their "
        "temperature, a top_p/top_k/min_p filter), engines serving other weights than the "
        "trainer's (another --model, a weight update that did not land), or another dtype or "
        "kernels on one side (bf16 engines against an fp32 trainer). train/logprob_abs_diff_max "
        "and train/mismatch_kl per step are in metrics.jsonl"
    )


def json_row(row: dict) -> str:
    """One metrics row as strict JSON: a NaN or infinite value (not JSON) is written null."""
    finite = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()
    }
    return json.dumps(finite, allow_nan=False)


def metrics_rows(run_dir: Path) -> Iterator[dict]:
    """The rows of a run folder's metrics.jsonl so far (a line cut short by a kill is passed
    over); a null value (a NaN when written) is read as NaN."""
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            yield {k: math.nan if v is None else v for k, v in row.items()}


def reward_failure_note(failed: float, timed_out: float) -> str:
    """The console's words for the share of a rollout batch's rewards that failed ("" none)."""
    if not failed > 0:
        return ""
    late = f", {timed_out:.0%} timed out: --rm-timeout-s" if timed_out > 0 else ""
    return (
        f" | reward errors {failed:.0%} (the reward raised, returned None/NaN or timed out"
        f"{late}; those samples are dropped: see logs/router.log)"
    )


def ends_a_line(path: Path) -> bool:
    """Whether `path` is empty or ends with a newline."""
    with path.open("rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


@dataclass
class RunProgress:
    """Folds the metrics stream into what the console and the summary show."""

    run_dir: Path
    resumed: bool = False  # a resume: the run's metrics.jsonl so far is folded in first
    replayed: int = 0  # a resume's steps trained after its checkpoint, trained again
    started_at: float = field(default_factory=time.monotonic)
    step: int = 0
    reward: float = math.nan
    accuracy: float = math.nan
    accuracy_version: int = -1
    first_accuracy: float = math.nan
    best_accuracy: float = math.nan
    samples_per_s: float = math.nan
    staleness: float = math.nan
    step_time_s: float = math.nan
    logprob_diff_step0: float = math.nan
    # Over every step with same-version samples: engines serve exactly the trainer's weights.
    logprob_diff_max: float = math.nan
    logprob_diff_steps: int = 0
    one_reward_steps: int = 0  # steps in a row whose every group had one reward (no signal)
    truncated: float = math.nan  # of the last rollout batch's responses, cut at the length bound
    samples_trained: int = 0  # of steps whose update was applied
    updates_skipped: int = 0  # steps whose update was skipped (non-finite): none trained
    history: list[dict] = field(default_factory=list)
    launch_steps: int = 0  # trainer steps recorded by this launch (a new lineage skips one)
    launch_samples: int = 0  # samples trained by the steps recorded by this launch
    eval_failed: int = 0  # held-out prompts of the last evaluation that failed
    eval_prompts: int = 0  # held-out prompts of the last evaluation
    mismatch_said: bool = False  # the log-prob mismatch warning was said (once a run)
    reward_failed: float = 0.0  # of the last rollout batch's rewards, the share that failed
    reward_timed_out: float = 0.0  # of them, the share that ran past --rm-timeout-s

    def __post_init__(self) -> None:
        if self.resumed:  # the totals and the plot are the whole run's
            for row in metrics_rows(self.run_dir):
                with contextlib.suppress(ValueError, TypeError, KeyError):  # (a row cut short)
                    self.fold(row)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        if not ends_a_line(self.run_dir / "metrics.jsonl"):  # a line cut short by a kill ends
            self.jsonl.write("\n")  # here, not in the next row

    def add(self, record: MetricsRecord) -> str | None:
        """Record one metrics message; return a console line when a trainer step completed."""
        row = {"source": record.source, "step": record.step, "time": record.time, **record.values}
        self.jsonl.write(json_row(row) + "\n")
        self.jsonl.flush()
        self.launch_steps += record.source == "trainer"
        before = self.samples_trained
        line = self.fold(row)
        self.launch_samples += self.samples_trained - before
        return line

    def fold(self, row: dict) -> str | None:
        """One row of metrics.jsonl into the totals; the console line of a trainer step."""
        self.history.append(row)
        if "eval/failed" in row:  # held-out prompts that failed (all: no accuracy measured)
            self.eval_failed = int(row["eval/failed"])
            self.eval_prompts = self.eval_failed + int(row.get("eval/num_prompts", 0))
        if "eval/accuracy" in row:
            self.accuracy = row["eval/accuracy"]
            self.accuracy_version = row["step"]
            if math.isnan(self.first_accuracy):
                self.first_accuracy = self.accuracy
            self.best_accuracy = max(
                self.accuracy, 0.0 if math.isnan(self.best_accuracy) else self.best_accuracy
            )
        if "rollout/samples_per_s" in row:
            self.samples_per_s = row["rollout/samples_per_s"]
            self.truncated = row.get("rollout/truncated_fraction", math.nan)
            self.reward_failed = row.get("rollout/reward_failed_fraction", 0.0)
            self.reward_timed_out = row.get("rollout/reward_timeout_fraction", 0.0)
        if row["source"] != "trainer":
            return None
        self.step = row["step"]
        self.reward = row.get("train/reward_mean", self.reward)
        self.staleness = row.get("train/staleness_mean", self.staleness)
        self.step_time_s = row.get("train/step_time_s", self.step_time_s)
        if row.get("train/update_skipped"):
            self.updates_skipped += 1
        else:
            self.samples_trained += int(row.get("train/samples", 0))
        diff = row.get("train/logprob_abs_diff_max", math.nan)
        if row["step"] == 1:
            self.logprob_diff_step0 = diff
        if not math.isnan(diff):  # NaN: no sample of this step came from the trainer's version
            self.logprob_diff_max = max(
                diff, 0.0 if math.isnan(self.logprob_diff_max) else self.logprob_diff_max
            )
            self.logprob_diff_steps += 1
        line = self.line()
        if not self.mismatch_said and (warning := mismatch_warning(diff, f"step {row['step']}")):
            self.mismatch_said, line = True, f"{line}\n{warning}"
        flat = row.get("train/groups_one_reward") == 1.0
        self.one_reward_steps = self.one_reward_steps + 1 if flat else 0
        if self.one_reward_steps != NO_SIGNAL_STEPS:
            return line
        return line + (  # (said once a streak)
            f"\n[up] for the last {NO_SIGNAL_STEPS} steps the samples of every group scored the "
            f"same (reward {self.reward:.3f}): their group-relative advantages were 0 and nothing "
            "was learned. The prompts are too hard (or too easy) for the model, or the reward "
            "does not tell its responses apart: look at some responses and their rewards "
            "(GET /rollout/samples on the router, or its dashboard)"
            + (
                f". {self.truncated:.0%} of the last rollout batch's responses were cut at "
                "--rollout-max-response-len (finish 'length'): raise it if answers need more room"
                if self.truncated >= 0.5
                else ""
            )
        )

    def line(self) -> str:
        elapsed = time.monotonic() - self.started_at
        failed = self.eval_failed
        if failed and failed == self.eval_prompts:
            accuracy = f"- (all {failed} failed)"
        elif math.isnan(self.accuracy):  # the first evaluation (of this launch) has not reported
            accuracy = "-"
        else:  # (some failed: a lower bound, they count as not solved)
            some = f", {failed} of {self.eval_prompts} failed" if failed else ""
            accuracy = f"{self.accuracy:.2f} (v{self.accuracy_version}{some})"
        rate = f"{self.samples_per_s:{'.0f' if self.samples_per_s >= 10 else '.2g'}}"
        rate = "-" if math.isnan(self.samples_per_s) else rate  # (a real model on a CPU: 0.27)
        return (
            f"step {self.step:4d} | reward {self.reward:.3f} | held-out acc {accuracy} | "
            f"{rate:>6} samples/s | "
            f"staleness {self.staleness:.2f} | {self.step_time_s:.2f} s/step | "
            f"{int(elapsed // 60)}:{int(elapsed % 60):02d}"
            + reward_failure_note(self.reward_failed, self.reward_timed_out)
        )

    def summary(self) -> dict:
        """The fields of summary.json that come from the metrics."""
        return {
            "steps": self.step,
            "steps_this_launch": self.launch_steps + self.replayed,
            "steps_trained_again": self.replayed,
            "accuracy_first": self.first_accuracy,
            "accuracy_last": self.accuracy,
            "accuracy_best": self.best_accuracy,
            "accuracy_version": self.accuracy_version,
            "samples_trained": self.samples_trained,
            "samples_trained_this_launch": self.launch_samples,
            "updates_skipped": self.updates_skipped,
            "logprob_abs_diff_max_step0": self.logprob_diff_step0,
            "logprob_abs_diff_max_same_version": self.logprob_diff_max,
            "steps_with_same_version_samples": self.logprob_diff_steps,
        }

    def sentences(
        self, outcome: str, wall_s: float, eval_task: str, versions: list[str]
    ) -> list[str]:
        """The console's summary of the run."""
        acc = f"{self.first_accuracy:.2f} -> {self.accuracy:.2f} (best {self.best_accuracy:.2f}; "
        if math.isnan(self.first_accuracy):  # no evaluation scored a prompt
            acc = "not measured ("
            if self.eval_failed:
                acc += f"every one of the {self.eval_failed} held-out prompts failed; "
        again = f", {self.replayed} of them again" if self.replayed else ""
        skipped = ""
        if self.updates_skipped:
            skipped = f" ({self.updates_skipped} updates skipped, their samples not trained)"
        run = f"; the run: at iteration {self.step}"  # (a resume's, or a --load's checkpoint's)
        if self.resumed:  # (the steps trained again are in metrics.jsonl once)
            run += f", {self.samples_trained} samples trained"
        out = [
            f"{outcome}: this launch: {self.launch_steps + self.replayed} steps{again}, "
            f"{self.launch_samples} samples trained{skipped}, in {wall_s / 60:.1f} min{run}, "
            f"held-out accuracy {acc}{eval_task}), engines on versions "
            f"{', '.join(versions) or '?'}"
        ]
        if not math.isnan(self.logprob_diff_step0):
            out.append(
                f"step-0 trainer/engine log-prob max abs diff: {self.logprob_diff_step0:.2e}"
            )
        if self.logprob_diff_steps:
            out.append(
                f"trainer/engine log-prob max abs diff on same-version samples, over "
                f"{self.logprob_diff_steps} steps: {self.logprob_diff_max:.2e}"
            )
        # (the step-0 diff is among the same-version ones)
        if warning := mismatch_warning(self.logprob_diff_max, "same-version samples"):
            out.append(warning)
        return out

    def close(self) -> None:
        self.jsonl.close()

    def plot(self, path: Path) -> Path:
        """One panel per quantity (reward, held-out accuracy, loss, trainer/engine log-prob
        mismatch, throughput) against the trainer step, as a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(len(PANELS), 1, figsize=(7, 2.2 * len(PANELS)), sharex=True)
        for ax, (title, curves) in zip(axes, PANELS, strict=True):
            drawn = 0
            for source, key, label in curves:
                points = [
                    (r["step"], r[key])
                    for r in self.history
                    if r.get("source") == source
                    and isinstance(r.get(key), (int, float))
                    and math.isfinite(r[key])
                ]
                if points:
                    ax.plot(
                        *zip(*points, strict=True),
                        label=label,
                        marker="." if source == "router" else None,
                    )
                    drawn += 1
            ax.set_title(title, fontsize=10, loc="left")
            ax.grid(alpha=0.3)
            if drawn > 1:  # (a legend of one curve only hides it; the title names it)
                ax.legend(fontsize=8, loc="best")
            elif not drawn:  # (a legend of nothing is a warning on the console)
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        axes[-1].set_xlabel("trainer step (weight version)")
        fig.suptitle(f"Tandem run {self.run_dir.name}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
