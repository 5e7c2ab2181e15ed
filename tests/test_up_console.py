"""`tandem up`'s console line: what it shows before the first evaluation and rollout figures."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from proto import MetricsRecord
from services.rollout_router.rollout import evaluation
from services.trainer.ckpt_folder import TRACKER
from tandem.progress import RunProgress, metrics_rows
from tandem.up_args import resume_plan


def test_the_console_line_shows_a_dash_until_accuracy_and_throughput_are_reported(
    tmp_path: Path,
) -> None:
    progress = RunProgress(tmp_path)
    first = progress.add(MetricsRecord(source="trainer", step=1, values={}, time=0.0))
    assert first is not None
    assert "held-out acc - |      - samples/s |" in first
    router = {"eval/accuracy": 0.25, "rollout/samples_per_s": 1234.0}
    assert progress.add(MetricsRecord(source="router", step=1, values=router, time=0.0)) is None
    second = progress.add(MetricsRecord(source="trainer", step=2, values={}, time=0.0))
    assert second is not None and "held-out acc 0.25 (v1) |   1234 samples/s" in second
    slow = {"rollout/samples_per_s": 0.2734}  # it said "0 samples/s"
    progress.add(MetricsRecord(source="router", step=2, values=slow, time=0.0))
    third = progress.add(MetricsRecord(source="trainer", step=3, values={}, time=0.0))
    assert third is not None and "|   0.27 samples/s |" in third
    progress.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5


def test_a_resumed_run_counts_the_whole_run_and_says_how_much_was_this_launch(
    tmp_path: Path,
) -> None:
    def step(progress: RunProgress, n: int, accuracy: float) -> None:
        values = {"train/samples": 512.0, "train/reward_mean": accuracy}
        progress.add(MetricsRecord(source="trainer", step=n, values=values, time=0.0))
        router = {"eval/accuracy": accuracy}
        progress.add(MetricsRecord(source="router", step=n, values=router, time=0.0))

    first = RunProgress(tmp_path)
    for n in (1, 2, 3):
        step(first, n, 0.1 * n)
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as jsonl:
        jsonl.write('{"source": "trainer", "st')  # the launcher killed mid-line
    resumed = RunProgress(tmp_path, resumed=True)
    step(resumed, 4, 0.9)
    summary = resumed.summary()
    assert (summary["steps"], summary["steps_this_launch"]) == (4, 1)
    assert (summary["samples_trained"], summary["samples_trained_this_launch"]) == (4 * 512, 512)
    assert (summary["accuracy_first"], summary["accuracy_last"]) == (0.1, 0.9)
    assert len(resumed.history) == 8, "the plot shows the whole run"
    assert [r["step"] for r in metrics_rows(tmp_path)] == [1, 1, 2, 2, 3, 3, 4, 4], "none lost"
    assert resumed.sentences("done", 60.0, "task", ["4"])[0].startswith(
        "done: this launch: 1 steps, 512 samples trained, in 1.0 min; the run: at iteration 4, "
        "2048 samples trained, held-out accuracy 0.10 -> 0.90"
    )
    resumed.close()
    # Its checkpoint was of step 1: steps 2 and 3 were trained again before step 4.
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / TRACKER).write_text("1")
    every, one_time = 1, False  # --save-interval; no --ckpt-step or --new-lineage given
    new_lineage, replayed, note = resume_plan(checkpoints, tmp_path, every, one_time, published=4)
    assert (new_lineage, replayed) == (False, 3)
    assert note.startswith("resuming from the step-1 checkpoint in ") and "steps 2-4 are" in note
    again = RunProgress(tmp_path, resumed=True, replayed=2)
    assert (again.step, again.summary()["steps_this_launch"]) == (4, 2)
    said = again.sentences("x", 6, "t", [])[0]
    assert "this launch: 2 steps, 2 of them again, 0 samples" in said and "iteration 4," in said
    again.close()
    (checkpoints / TRACKER).write_text("4")
    assert resume_plan(checkpoints, tmp_path, every, one_time, published=4) == (False, 0, "")
    (checkpoints / TRACKER).unlink()  # none saved: a new lineage after the published version
    new_lineage, replayed, note = resume_plan(checkpoints, tmp_path, every, one_time, published=4)
    assert (new_lineage, replayed) == (True, 0) and "holds no checkpoint" in note
    # its first version (5) is --model's again, not a step: it trained steps 6 and 7 only
    lineage = RunProgress(tmp_path, resumed=True)
    step(lineage, 6, 0.2)
    step(lineage, 7, 0.3)
    assert (lineage.step, lineage.summary()["steps_this_launch"]) == (7, 2)
    said = lineage.sentences("x", 6, "t", [])[0]
    assert "this launch: 2 steps, 1024 samples trained" in said and "iteration 7," in said
    lineage.close()
    assert resume_plan(checkpoints, tmp_path, every, one_time, published=0) == (False, 0, "")
    fresh = RunProgress(tmp_path)  # a new run in that folder: only its own records count
    step(fresh, 1, 0.5)
    assert (fresh.summary()["samples_trained"], fresh.summary()["steps_this_launch"]) == (512, 1)
    fresh.close()


def run_evaluation_publish(values: dict[str, float], exact: list[bool]) -> None:
    """`values` as the router's evaluation publishes them for `exact` and `eval/failed`."""
    published: list[dict[str, float]] = []

    async def publish_metrics(source: str, step: int, got: dict[str, float]) -> None:
        published.append(got)

    loop = SimpleNamespace(buffer=SimpleNamespace(publish_metrics=publish_metrics))
    failed = int(values["eval/failed"])
    rewards = [1.0 if e else 0.0 for e in exact]
    asyncio.run(evaluation._publish(loop, 0, rewards, exact, failed))  # type: ignore[arg-type]
    values.update(published[0])


def test_an_evaluation_whose_every_prompt_failed_reports_no_accuracy(tmp_path: Path) -> None:
    """The router leaves eval/accuracy out when no held-out prompt was scored (a reward that
    always raises): the console says so, never 'held-out accuracy 0.00'. One where some failed
    (an environment lost half way) counts them as not solved: the few prompts that finished
    must not read as the task's accuracy (--stop-accuracy would stop on it)."""
    progress = RunProgress(tmp_path)
    failed = {"eval/num_prompts": 0.0, "eval/failed": 20.0}
    progress.add(MetricsRecord(source="router", step=0, values=failed, time=0.0))
    line = progress.add(MetricsRecord(source="trainer", step=1, values={}, time=0.0))
    assert line is not None and "held-out acc - (all 20 failed) |" in line
    assert progress.sentences("unhealthy", 60.0, "task", [])[0].startswith(
        "unhealthy: this launch: 1 steps, 0 samples trained, in 1.0 min; the run: at iteration "
        "1, held-out accuracy not measured (every one of the 20 held-out prompts failed; task)"
    )
    # an evaluation cut short: its failed prompts count as not solved, and the line says so
    partial: dict[str, float] = {"eval/num_prompts": 4.0, "eval/failed": 16.0}
    run_evaluation_publish(partial, exact=[True] * 4)
    assert partial["eval/accuracy"] == 0.2  # 4 solved of 20, not 4 of the 4 that finished
    progress.add(MetricsRecord(source="router", step=0, values=partial, time=0.0))
    line = progress.add(MetricsRecord(source="trainer", step=1, values={}, time=0.0))
    assert line is not None and "held-out acc 0.20 (v0, 16 of 20 failed) |" in line
    scored = {"eval/accuracy": 0.5, "eval/num_prompts": 20.0, "eval/failed": 0.0}
    progress.add(MetricsRecord(source="router", step=1, values=scored, time=0.0))
    line = progress.add(MetricsRecord(source="trainer", step=2, values={}, time=0.0))
    assert line is not None and "held-out acc 0.50 (v1) |" in line
    assert (
        "held-out accuracy 0.20 -> 0.50 (best 0.50; task)"
        in progress.sentences("done", 60.0, "task", ["2"])[0]
    )
    progress.close()


def test_the_plot_of_a_run_where_no_step_ran_warns_nothing(tmp_path: Path) -> None:
    """Before, matplotlib's warning of a legend of nothing reached the console at the end of a
    run that failed before its first step."""
    import warnings

    progress = RunProgress(tmp_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            path = progress.plot(tmp_path / "metrics.png")
    finally:
        progress.close()
    assert path.stat().st_size > 0


def test_a_streak_of_steps_whose_every_group_scored_the_same_is_said_once(tmp_path: Path) -> None:
    """A task the model never solves (or always does) trained on nothing, step after step,
    without a word: every group-relative advantage was 0."""
    from tandem.progress import NO_SIGNAL_STEPS

    progress = RunProgress(tmp_path)
    lines = []
    for step, one in enumerate([0.5] + [1.0] * (NO_SIGNAL_STEPS + 3), start=1):
        values = {"train/groups_one_reward": one, "train/reward_mean": 0.0}
        lines.append(
            progress.add(MetricsRecord(source="trainer", step=step, values=values, time=0.0))
        )
    said = [line for line in lines if line and "\n[up] " in line]
    assert len(said) == 1 and said[0] is lines[NO_SIGNAL_STEPS], said
    assert (
        said[0]
        .split("\n")[1]
        .startswith(
            f"[up] for the last {NO_SIGNAL_STEPS} steps the samples of every group scored the same "
            "(reward 0.000): their group-relative advantages were 0 and nothing was learned."
        )
    )
    # the likely cause, when it is one: responses cut at the length bound
    cut = {"rollout/samples_per_s": 9.0, "rollout/truncated_fraction": 0.9}
    progress.add(MetricsRecord(source="router", step=1, values=cut, time=0.0))
    for step in range(NO_SIGNAL_STEPS + 4, 2 * NO_SIGNAL_STEPS + 5):  # a reset, then 20
        values = {"train/groups_one_reward": 0.5 if step == NO_SIGNAL_STEPS + 4 else 1.0}
        line = progress.add(MetricsRecord(source="trainer", step=step, values=values, time=0.0))
    assert line is not None and line.endswith(
        "dashboard). 90% of the last rollout batch's responses were cut at "
        "--rollout-max-response-len (finish 'length'): raise it if answers need more room"
    ), line
    progress.close()


def test_the_samples_of_a_step_whose_update_was_skipped_are_not_counted_trained(
    tmp_path: Path,
) -> None:
    progress = RunProgress(tmp_path)
    for n, skipped in ((1, 0.0), (2, 1.0), (3, 0.0)):
        values = {"train/samples": 64.0, "train/update_skipped": skipped}
        progress.add(MetricsRecord(source="trainer", step=n, values=values, time=0.0))
    progress.close()
    summary = progress.summary()
    assert (summary["samples_trained"], summary["updates_skipped"]) == (128, 1)
    said = progress.sentences("max_steps", 60.0, "task", ["3"])[0]
    assert "128 samples trained (1 updates skipped, their samples not trained)" in said, said


def test_a_trainer_engine_log_prob_mismatch_past_the_threshold_is_said_once_with_its_causes(
    tmp_path: Path,
) -> None:
    """A temperature the trainer did not apply gave a step-0 diff of 0.498 and a run that
    exited 0 without a word."""
    from tandem.progress import LOGPROB_DIFF_WARN

    progress = RunProgress(tmp_path)
    lines = []
    for step, diff in enumerate([1e-6, float("nan"), 0.498, 0.84], start=1):
        values = {"train/logprob_abs_diff_max": diff}
        lines.append(
            progress.add(MetricsRecord(source="trainer", step=step, values=values, time=0.0))
        )
    warned = [line for line in lines if line and "\n[up] warning" in line]
    assert len(warned) == 1 and warned[0] is lines[2], lines
    said = warned[0].split("\n")[1]
    assert f"by up to 0.498 on step 3 (more than {LOGPROB_DIFF_WARN})" in said
    assert "temperature" in said and "top_p" in said and "bf16" in said and "weights" in said
    end = progress.sentences("max_steps", 60.0, "task", ["4"])
    assert end[-1].startswith("[up] warning: the trainer's log-probs differ from the engines' ")
    assert "by up to 0.840 on same-version samples" in end[-1]
    progress.close()
    (tmp_path / "quiet").mkdir()
    quiet = RunProgress(tmp_path / "quiet")
    for step in (1, 2):
        values = {"train/logprob_abs_diff_max": LOGPROB_DIFF_WARN / 2}
        line = quiet.add(MetricsRecord(source="trainer", step=step, values=values, time=0.0))
        assert line is not None and "\n" not in line
    assert not any("warning" in s for s in quiet.sentences("max_steps", 1.0, "task", ["2"]))
    quiet.close()


def test_a_launch_from_another_runs_checkpoint_counts_its_own_steps_not_the_iteration(
    tmp_path: Path,
) -> None:
    """A new run given --load of a checkpoint at iteration 40 trains 41..45: the old summary
    said '45 steps'; it says what this launch trained, and where the run's iteration is."""
    progress = RunProgress(tmp_path)
    for n in range(41, 46):
        values = {"train/samples": 64.0}
        progress.add(MetricsRecord(source="trainer", step=n, values=values, time=0.0))
    progress.close()
    summary = progress.summary()
    assert (summary["steps"], summary["steps_this_launch"]) == (45, 5)
    assert summary["samples_trained_this_launch"] == 5 * 64
    said = progress.sentences("max_steps", 60.0, "task", ["45"])[0]
    assert said.startswith(
        "max_steps: this launch: 5 steps, 320 samples trained, in 1.0 min; the run: at "
        "iteration 45, held-out accuracy"
    ), said
