"""`tandem up`'s command line (service settings, --resume) and its progress watchdog, without
starting a run: the launcher's checks refuse before anything starts, and the watchdog reads real
status records from a real Redis server and real /health answers over HTTP."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from proto.contract import ServiceStatus
from services.common.settings import flat
from services.sample_buffer import SampleBuffer
from tandem import launcher
from tandem import watchdog as watchdog_module
from tandem.toy_model import write_toy_model
from tandem.up_args import resume_argv, resumed, save_config
from tandem.up_launch import UpConfig
from tandem.up_tree import compose, render
from tandem.watchdog import Watchdog, diagnosis
from tests.helpers import JsonHandler, serving, wait_until


def test_a_run_term_given_to_a_service_otherwise_is_refused_naming_both(capsys) -> None:
    code = launcher.main(["--router.rollout-batch-size", "16", "--run-dir", "/nonexistent"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--router.rollout-batch-size 16, but [up] rollout_batch_size = 64" in err
    # The same value twice is no contradiction.
    args = ["--rollout-batch-size", "16", "--router.rollout-batch-size", "16"]
    assert launcher.main([*args, "--max-steps", "0"]) == 2
    assert "rollout-batch-size" not in capsys.readouterr().err


def test_a_service_setting_is_a_flag_of_tandem_up_bare_or_named_by_its_service() -> None:
    tree, problems = launcher.parse(
        ["--rollout-temperature", "0.7", "--trainer.num-threads", "2", "--no-bf16"]
    )
    assert problems == [] and tree is not None
    assert tree.value("router", "rollout_temperature") == 0.7
    assert (tree.value("trainer", "num_threads"), tree.value("trainer", "bf16")) == (2, False)
    _tree, problems = launcher.parse(["--num-threads", "2"])
    assert problems == [
        "--num-threads is a setting of the trainer and the engine: give --trainer.num-threads "
        "or --engine.num-threads"
    ]
    _tree, problems = launcher.parse(["--trainer-args", "--bf16"])
    assert "--trainer-args is gone: give the trainer's flags to tandem up itself" in problems[0]


def saved_run(run: Path, **fields: object) -> dict:
    """A run folder's up_config.json as tandem up saves it (its model in the folder)."""
    (run / "model").mkdir(parents=True, exist_ok=True)
    (run / "model" / "config.json").write_text('{"model_type": "llama"}')
    (run / "model" / "tokenizer.json").write_text("{}")  # (tandem up looks for one)
    saved = {**flat(UpConfig()), "model": str(run / "model"), "run_dir": str(run), **fields}
    (run / "up_config.json").write_text(json.dumps(saved))
    return saved


def test_a_config_files_tables_beside_resume_override_the_saved_run_as_its_flags_do(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """`tandem up --resume RUN --config FILE`: FILE's tables were silently overridden by the
    saved configuration (max_steps = 9 resumed to the saved 5; a contract term such as
    rollout_batch_size = 32 ran at the saved 64, without a word). A run's own config.toml
    changes nothing."""
    run = tmp_path / "run"
    saved = saved_run(run)
    tree, _ = launcher.parse(["--max-steps", "5"])
    assert tree is not None
    (run / "config.toml").write_text(render(tree, {"model": saved["model"]}))
    started = []
    monkeypatch.setattr("tandem.up_run.UpRun.run", lambda self: started.append(self.tree) or 0)
    more = tmp_path / "more.toml"
    more.write_text("[trainer]\nmax_steps = 9\n")
    assert launcher.main(["--resume", str(run), "--config", str(more)]) == 0
    trainer = started[-1].trainer
    assert (trainer.batch.max_steps, trainer.optimizer.lr) == (9, 1e-3)
    assert launcher.main(["--resume", str(run), "--config", str(more), "--max-steps", "8"]) == 0
    assert started[-1].value("trainer", "max_steps") == 8, "a flag over the file, as everywhere"
    more.write_text("[trainer]\nmax_steps = 9\n\n[up]\nrollout_batch_size = 32\n")
    assert launcher.main(["--resume", str(run), "--config", str(more)]) == 2
    assert "rollout-batch-size is part of the run contract" in capsys.readouterr().err
    assert launcher.main(["--resume", str(run), "--config", str(run / "config.toml")]) == 0
    resumed = started[-1]
    assert (resumed.value("trainer", "max_steps"), resumed.up.run.model) == (5, saved["model"])


def test_a_resume_beside_services_of_an_earlier_launch_still_running_is_refused_naming_them(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """`tandem up` killed by SIGKILL: its services get SIGTERM and may take long to stop (the
    trainer saves its checkpoint) or run on (stopped, ignoring it); a resume started a second
    set beside them, on the same checkpoints, without a word."""
    run = tmp_path / "run"
    saved_run(run)
    started = []
    monkeypatch.setattr("tandem.up_run.UpRun.run", lambda self: started.append(self.tree) or 0)
    sleep = "import time; time.sleep(60)"
    left = subprocess.Popen([sys.executable, "-c", sleep, "--config", str(run / "config.toml")])
    try:
        # (its command line reads empty, or as pytest's, until the child has exec'd)
        wait_until(
            lambda: psutil.Process(left.pid).cmdline()[-1:] == [str(run / "config.toml")], "it"
        )
        assert launcher.main(["--resume", str(run)]) == 2
        err = capsys.readouterr().err
        assert f"{run}: services of an earlier launch still run: {sys.executable} (pid " in err
        assert f"(pid {left.pid}); wait for them to stop" in err and not started
    finally:
        left.kill()
        left.wait()
    assert launcher.main(["--resume", str(run)]) == 0 and started


def test_resume_keeps_the_saved_configuration_and_refuses_a_new_contract(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    run = tmp_path / "run"
    saved_run(run, seed=7)
    shutil.rmtree(run / "model")
    assert launcher.main(["--resume", str(run), "--rollout-batch-size", "32"]) == 2
    err = capsys.readouterr().err
    assert "rollout-batch-size is part of the run contract" in err
    started = []
    monkeypatch.setattr("tandem.up_run.UpRun.run", lambda self: started.append(self.tree) or 0)
    saved_run(run, seed=7)
    assert launcher.main(["--resume", str(run), "--max-steps", "5"]) == 0
    tree = started[0]
    assert (tree.up.run.seed, tree.value("trainer", "max_steps"), tree.up.run_dir) == (
        7,
        5,
        str(run),
    )
    # a run whose checkpoint reached --max-steps (the run's total) has nothing to train
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("5")
    assert launcher.main(["--resume", str(run), "--max-steps", "5"]) == 2
    assert (
        f"--resume {run}: its checkpoint is at step 5, and --max-steps 5 is the run's total: "
        f"nothing to train; continue it with a higher --max-steps (tandem up --resume {run} "
        "--max-steps 10)"
    ) in capsys.readouterr().err
    assert launcher.main(["--resume", str(run), "--max-steps", "6"]) == 0
    # A folder moved elsewhere: its model goes with it.
    moved = tmp_path / "moved"
    run.rename(moved)
    assert launcher.main(["--resume", str(moved), "--max-steps", "6"]) == 0
    assert started[-1].up.run.model == str(moved / "model")
    assert launcher.main(["--resume", str(moved), "--model", str(tmp_path)]) == 2
    assert f"--model {tmp_path} cannot change on resume" in capsys.readouterr().err
    assert launcher.main(["--resume", str(moved), "--model", str(moved / "model")]) == 0
    assert launcher.main(["--resume", str(moved), "--seed", "8", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "--seed orders the run's prompts (7 so far)" in err
    assert "seed is part of the run contract" not in err  # (said once, not twice)
    assert f"--resume {moved} is the run folder: leave out --run-dir" in err
    run = moved.rename(run)
    # a run that trained past --save-interval whose checkpoints are gone: refused, not a
    # silent start over from --model
    shutil.rmtree(run / "checkpoints")
    rows = [{"source": "trainer", "step": s, "time": 0.0} for s in (1, 2, 10, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut')
    assert launcher.main(["--resume", str(run), "--max-steps", "20"]) == 2
    assert (
        f"the run trained 11 steps, saving every --save-interval 10, but {run / 'checkpoints'} "
        "is gone (moved or deleted?)"
    ) in capsys.readouterr().err
    flags = ["--max-steps", "20", "--new-lineage"]
    assert launcher.main(["--resume", str(run), *flags]) == 0  # starting over, as asked
    # a run that ended before its first --save-interval saved at its end: the same (it went
    # on from --model, the note guessing "none saved yet")
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    (run / "checkpoints").mkdir()
    (run / "summary.json").write_text(json.dumps({"checkpoint_step": 3}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert launcher.main(["--resume", str(run), "--max-steps", "20"]) == 2
    assert (
        f"the run saved a checkpoint of step 3, but {run / 'checkpoints'} holds none (moved or "
        "deleted?)"
    ) in capsys.readouterr().err
    assert not (tmp_path / "missing" / "up_config.json").exists()
    assert launcher.main(["--resume", str(tmp_path / "missing")]) == 2
    assert "not a tandem up run folder" in capsys.readouterr().err


def test_a_file_given_relative_to_a_service_is_saved_absolute(tmp_path: Path, monkeypatch) -> None:
    """train-your-model.md's `--eval-prompt-data data/eval.jsonl`: saved as given, a resume
    from another folder had its router refuse to start ("no such file")."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "tok").mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        (project / "data" / name).write_text('{"prompt": "1", "label": "1"}\n')
    monkeypatch.chdir(project)
    started = []
    monkeypatch.setattr("tandem.up_run.UpRun.run", lambda self: started.append(self) or 0)
    kwargs = ["--apply-chat-template-kwargs", '{"enable_thinking": false}']
    flags = ["--prompt-data", "data/train.jsonl", "--rm-type", "exact_match", "--run-dir", "run"]
    router = ["--eval-prompt-data", "data/eval.jsonl", "--eval-interval", "10", *kwargs]
    assert launcher.main([*flags, *router, "--engine.tokenizer=tok"]) == 0
    tree = started[0].tree
    assert tree.value("router", "eval_prompt_data") == str(project / "data" / "eval.jsonl")
    assert tree.value("router", "apply_chat_template_kwargs") == kwargs[1]
    assert tree.value("engine", "tokenizer") == str(project / "tok")
    started[0].lock.close()
    flags[-1] = "run2"  # a string naming no file is kept as it was written
    assert launcher.main([*flags, *kwargs, "--engine.tokenizer", "not-here"]) == 0
    assert started[1].tree.value("engine", "tokenizer") == "not-here"


def test_a_new_run_saves_absolute_paths_so_it_resumes_from_any_folder(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "rewards.py").write_text("def score(text, label, stopped):\n    return 1.0\n")
    (project / "data" / "train.jsonl").write_text('{"prompt": "1", "label": "1"}\n')
    monkeypatch.chdir(project)
    started = []
    monkeypatch.setattr("tandem.up_run.UpRun.run", lambda self: started.append(self) or 0)
    flags = ["--custom-rm-path", "rewards.py:score", "--prompt-data", "data/train.jsonl"]
    assert launcher.main([*flags, "--run-dir", "run", "--save", "ck", "--label-key", "label"]) == 0
    tree, run_dir = started[0].tree, started[0].run_dir
    assert tree.value("router", "custom_rm_path") == f"{project / 'rewards.py'}:score"
    assert (tree.value("router", "prompt_data"), tree.value("trainer", "save")) == (
        str(project / "data" / "train.jsonl"),
        str(project / "ck"),
    )
    assert run_dir == project / "run"
    (project / "my_rewards.py").write_text("def score(text, label, stopped):\n    return 1.0\n")
    assert launcher.main(["--custom-rm-path", "my_rewards:score", "--run-dir", "r2"]) == 0
    assert started[1].tree.value("router", "custom_rm_path") == "my_rewards:score", "a module"
    # A module path is looked up where the router will look, before anything starts: from
    # another folder it is not there, and the refusal says what to do; a resume finds it in the
    # folder its run was started from (saved in the run folder), and gives that to the services.
    run = project / "r2"
    save_config(run, started[1].tree, "")  # (run() is replaced here: as start_services saves)
    (run / "config.toml").write_text(render(started[1].tree, {}))
    started[1].lock.close()  # that run has ended
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert launcher.main(["--custom-rm-path", "my_rewards:score"]) == 2
    assert (
        f"--custom-rm-path my_rewards:score: no module my_rewards in the current folder "
        f"({elsewhere}) or on PYTHONPATH: run tandem up from the folder that holds it"
    ) in capsys.readouterr().err
    assert launcher.main(["--custom-rm-path", "score"]) == 2  # no module named at all
    assert "--custom-rm-path score: give the module and the function" in capsys.readouterr().err
    monkeypatch.setattr(sys, "path", list(sys.path))  # (both restored after the test)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere/lib")
    assert launcher.main(["--resume", str(run)]) == 0
    assert len(started) == 3
    assert f"my_rewards is in {project}, where the run started" in capsys.readouterr().out
    assert os.environ["PYTHONPATH"] == f"{project}{os.pathsep}/elsewhere/lib"
    save_config(run, started[2].tree, "")  # the resumed run saves it again, from elsewhere
    assert json.loads((run / "up_config.json").read_text())["launch_dir"] == str(project)
    # a resume's own flags are made absolute too (its up_config.json is saved again)
    started[2].lock.close()
    (elsewhere / "more.jsonl").write_text('{"prompt": "2", "label": "2"}\n')
    flags = ["--eval-prompt-data", "more.jsonl", "--label-key", "label"]
    assert launcher.main(["--resume", str(run), *flags]) == 0
    assert started[3].tree.value("router", "eval_prompt_data") == str(elsewhere / "more.jsonl")


def test_a_resume_on_other_prompts_is_refused_before_anything_starts_naming_both(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """The training prompts are a run term: a resume given another --prompt-data (or the
    run's file changed since) was refused only by the router, after the engines had loaded."""
    monkeypatch.chdir(tmp_path)
    first, other = tmp_path / "train.jsonl", tmp_path / "other.jsonl"
    first.write_text('{"prompt": "1", "label": "1"}\n')
    other.write_text('{"prompt": "2", "label": "2"}\n')
    started = []
    monkeypatch.setattr("tandem.up_run.UpRun.run", lambda self: started.append(self) or 0)
    flags = ["--prompt-data", str(first), "--rm-type", "exact_match", "--run-dir", "run"]
    assert launcher.main(flags) == 0
    run = started[0].run_dir
    save_config(run, started[0].tree, "")  # as start_services does
    (run / "config.toml").write_text(render(started[0].tree, {}))
    started[0].lock.close()
    assert launcher.main(["--resume", str(run), "--prompt-data", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--resume: --prompt-data is part of the run contract of {run}" in err
    assert f"the run trains on {first} (sha256 of the file " in err
    assert f"this resume was given {other} (sha256 of the file " in err
    assert not started[1:], "nothing started"
    shutil.copy(first, tmp_path / "moved.jsonl")  # the same prompts in another file: taken
    assert launcher.main(["--resume", str(run), "--prompt-data", "moved.jsonl"]) == 0
    started[1].lock.close()
    first.write_text('{"prompt": "3", "label": "3"}\n')  # the run's file changed since
    assert launcher.main(["--resume", str(run)]) == 2
    assert "--prompt-data is part of the run contract" in capsys.readouterr().err


def test_a_data_file_that_is_not_there_is_refused_before_anything_starts(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert launcher.main(["--prompt-data", "train.jsonl", "--eval-prompt-data", "ev.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "--prompt-data train.jsonl: no such file" in err
    assert "--eval-prompt-data ev.jsonl: no such file" in err
    assert not (tmp_path / "runs").exists(), "nothing started"


def test_settings_a_service_would_refuse_are_refused_before_anything_starts(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Each service's own checks, and a data file's first row, run in tandem up's parse: they
    failed only after Redis and the engines had started (minutes for a model)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "q.jsonl").write_text('\n{"question": "1+1", "label": "2"}\n')
    (tmp_path / "bad.jsonl").write_text("not json\n")
    (tmp_path / "rows.csv").write_text("prompt,label\n")
    (tmp_path / "broken.parquet").write_text("not parquet")
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "b0.toml").write_text("[broker]\nsync_timeout_s = 0\n")
    (tmp_path / "my old").mkdir()
    (tmp_path / "my old" / "up_config.json").write_text("{}")  # a run folder
    # what a run left without its configuration: a new run went on from step 400 silently
    (tmp_path / "left" / "checkpoints").mkdir(parents=True)
    (tmp_path / "left" / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("400")
    (tmp_path / "left" / "redis").mkdir()
    (tmp_path / "left" / "redis" / "appendonlydir").mkdir()
    (tmp_path / "spare").mkdir()
    cases = {
        ("--rollout-batch-size", "0"): "--rollout-batch-size 0: must be at least 1",
        ("--n-samples-per-prompt", "1"): "trainer: --n-samples-per-prompt 1 with",
        # (the command quoted for a shell: the folder's name has a space)
        ("--run-dir", "my old"): "--run-dir my old holds a run already: continue it with "
        "tandem up --resume 'my old', or give another --run-dir",
        ("--run-dir", "left"): "--run-dir left holds what an earlier run left, without its "
        "up_config.json: left/checkpoints (step 400) and left/redis; a new run would go on from "
        "them (the trainer from the checkpoint, not --model;",
        # (without --run-dir too: a new run went on from another run's checkpoint silently)
        ("--run-dir", "spare", "--save", "left/checkpoints"): "left/checkpoints holds another "
        "run's checkpoint (iteration 400): a new run would go on from it, not from --model. "
        "Continue that run with tandem up --resume RUN_DIR, start a new one from its weights "
        "with --load",
        ("--save", "left/checkpoints"): "left/checkpoints holds another run's checkpoint",
        # (a --load launch at or below its checkpoint's iteration trained nothing, exit 0)
        ("--load", "left/checkpoints", "--max-steps", "400"): "--max-steps 400 is the run's "
        "last iteration, and the checkpoint of --load",
        ("--load", "left/checkpoints", "--max-steps", "30"): "is at iteration 400: nothing "
        "would train; give --max-steps 430 to train 30 steps from it",
        # two rewards: the router took --rm-url over the other without a word
        ("--rm-type", "boxed", "--rm-url=http://127.0.0.1:9/score"): (
            "router: give one reward, not --rm-type boxed and --rm-url http://127.0.0.1:9/score"
        ),
        ("--trainer-procs", "0"): "--trainer-procs 0: must be at least 1",
        # (a service refused them once Redis and the engines were up)
        ("--update-timeout-s=nan",): "engine: --update-timeout-s nan: ",
        ("--request-timeout-s=-3",): "router: --request-timeout-s -3: must be at least 0",
        ("--max-batch-size=0",): "engine: --max-batch-size 0: must be at least 1",
        (
            "--config",
            "b0.toml",
        ): "broker: b0.toml: [broker] sync_timeout_s = 0: must be more than 0",
        ("--rm-type", "boxed", "--env-url", "http://127.0.0.1:9"): (  # (--rm-type was unused)
            "give one reward, not --rm-type boxed and --env-url http://127.0.0.1:9 (its /step"
        ),
        ("--kl-coef=0.1",): (
            "trainer: --kl-coef > 0 needs --ref-load (the frozen reference model)"
        ),
        ("--prompt-data", "q.jsonl", "--rm-type", "exact_match"): (
            "q.jsonl: row 2 has no 'prompt' (--input-key, a flag of tandem up and of the router, "
            "names the prompt's field): it has ['label', 'question']"
        ),
        ("--prompt-data", "bad.jsonl", "--rm-type", "exact_match"): "bad.jsonl:1: not JSON",
        ("--prompt-data", "rows.csv", "--rm-type", "exact_match"): (
            "rows.csv:1: not JSON (Expecting value: line 1 column 1 (char 0); a data file is JSON "
            "lines, a JSON array or .parquet)"
        ),
        ("--prompt-data", "broken.parquet", "--rm-type", "exact_match"): (
            "broken.parquet: not a Parquet file (Parquet magic bytes not found"
        ),
        ("--prompt-data", "folder.jsonl", "--rm-type", "exact_match"): ("folder.jsonl: not a file"),
    }
    for argv, expected in cases.items():
        assert launcher.main(list(argv)) == 2, argv
        assert expected in capsys.readouterr().err, argv
    _config, problems = launcher.parse(
        ["--prompt-data", "q.jsonl", "--input-key", "question", "--rm-type", "exact_match"]
    )
    assert problems == []
    assert not (tmp_path / "runs").exists(), "nothing started"


def test_a_bad_row_past_the_first_is_refused_before_anything_starts(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """tandem up reads every row of a .jsonl data file before it starts anything: a bad later
    row used to be found by the router after the engines had loaded (minutes, with a real
    model). Exit 2 with the file and line, nothing started."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "late.jsonl").write_text('{"prompt": "12>", "label": "21"}\n{not json\n')
    (tmp_path / "keys.jsonl").write_text('{"prompt": "12>"}\n\n{"question": "21>"}\n')
    for data, expected in (
        ("late.jsonl", "late.jsonl:2: not JSON"),
        ("keys.jsonl", "keys.jsonl: row 3 has no 'prompt'"),
    ):
        argv = ["--prompt-data", data, "--rm-type", "exact_match", "--run-dir", "r"]
        assert launcher.main([*argv, "--max-steps", "1"]) == 2
        said = capsys.readouterr()
        assert expected in said.err and "engines at" not in said.out, said
        assert not (tmp_path / "r").exists(), "nothing started"


def test_the_watchdog_prints_what_each_service_waits_for_then_ends_a_stalled_run(
    buffer: SampleBuffer,
) -> None:
    said: list[str] = []
    status = ServiceStatus(
        role="router",
        state="waiting",
        waiting_for="engines on weight version >= 71 (they serve 0)",
        since=time.time() - 30,
    )
    buffer.set_status(status)
    note = "9 groups dropped since the last one put (env_error 9; the last: HTTP 500)"
    buffer.set_status(ServiceStatus(role="broker", state="idle", detail={"note": note}))
    watchdog = Watchdog(buffer, {}, stall_warn_s=0.2, stall_fail_s=0.6, say=said.append)
    assert watchdog.check() == ""
    time.sleep(0.3)
    assert watchdog.check() == ""
    text = "\n".join(said)
    assert "no progress for" in text
    assert "router [waiting, 30 s]: waits for engines on weight version >= 71" in text
    assert "trainer: no status reported" in text
    assert f"broker [idle]: is not waiting; {note}" in text
    busy = "64 groups in flight: 0 requests at the engines; 512 calls to reward function f ..."
    generating = ServiceStatus(role="router", state="generating", detail={"busy": busy})
    assert f"  router [generating]: is busy with {busy}" in diagnosis({"router": generating}, 0)
    # a step of a real model on a CPU takes minutes: it said "[training]: is not waiting"
    training = ServiceStatus(role="trainer", state="training", since=40.0, detail={"step": 1})
    assert (
        diagnosis({"trainer": training}, 98.0)[0]
        == "  trainer [training, 58 s]: is training step 1"
    )
    watchdog.step_done(3)
    assert watchdog.check() == ""  # a step completed: the stall clock starts again
    time.sleep(0.7)
    problem = watchdog.check()
    assert problem.startswith("no progress for") and "weight version >= 71" in problem
    # past its last step (--max-steps) the trainer saves and closes: said as such, still bounded
    ending = Watchdog(buffer, {}, stall_warn_s=0.2, stall_fail_s=0.6, say=said.append, max_steps=3)
    ending.step_done(3)
    time.sleep(0.3)
    assert ending.check() == ""
    headline = re.compile(r"the trainer has not ended \d+ s after its last step \(saving, closing")
    assert [line for line in said if headline.match(line)], said
    time.sleep(0.4)
    assert headline.match(ending.check()) and "--stall-fail-s" in ending.check()
    # --stall-fail-s under --stall-warn-s: the run ends at its own bound (it waited for the
    # warning's, 60 s by default, whatever --stall-fail-s said)
    early = Watchdog(buffer, {}, stall_warn_s=60, stall_fail_s=0.3, say=said.append)
    time.sleep(0.4)
    problem = early.check()
    assert problem.startswith("no progress for 0 s") and "--stall-fail-s" in problem, problem


def test_a_stall_report_names_a_redis_that_refuses_writes_and_what_to_change(
    buffer: SampleBuffer,
) -> None:
    """A Redis whose disk is full (MISCONF; here OOM at a maxmemory of 1 byte) takes no status:
    the report said "no status reported" of every service, stuck or starting, nothing of why."""
    said: list[str] = []
    watchdog = Watchdog(buffer, {}, stall_warn_s=0.2, stall_fail_s=60, say=said.append)
    assert watchdog.report(1.0)[0].startswith("  trainer: no status reported"), "takes writes"
    buffer.redis.config_set("maxmemory", 1)
    try:
        assert watchdog.check() == ""
        time.sleep(0.3)
        assert watchdog.check() == ""
    finally:
        buffer.redis.config_set("maxmemory", 0)
    (line,) = [line for line in said if line.startswith("  redis:")]
    assert "refuses writes (" in line and "raise maxmemory" in line, said


def test_groups_reaching_the_trainer_are_progress_and_groups_dropped_are_not(
    buffer: SampleBuffer, monkeypatch
) -> None:
    """A real model's first rollout may take longer than --stall-warn-s: groups arriving in the
    trainer's hands keep the run alive; a trainer whose groups stop coming stalls it."""
    monkeypatch.setattr(watchdog_module, "HEALTH_INTERVAL_S", 0.05)
    said: list[str] = []
    watchdog = Watchdog(buffer, {}, stall_warn_s=0.3, stall_fail_s=0.6, say=said.append)

    def trainer(in_hand: int) -> None:
        detail: dict[str, float | int | str] = {"groups_in_hand": in_hand, "groups_put": 99}
        buffer.set_status(ServiceStatus(role="trainer", state="waiting", detail=detail))

    for in_hand in range(12):  # 1.2 s, twice --stall-fail-s
        trainer(in_hand)
        time.sleep(0.1)
        assert watchdog.check() == "", in_hand
    assert said == []
    deadline = time.monotonic() + 3
    while not (problem := watchdog.check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert problem.startswith("no progress for") and "--stall-fail-s" in problem
    assert said and said[0].startswith("no progress for")


def test_the_watchdog_ends_the_run_when_a_service_answers_unhealthy(buffer: SampleBuffer) -> None:
    class Failed(JsonHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server names it
            self.send_json(503, {"status": "failed", "error": "rollout loop died: KeyError"})

    with serving(Failed) as url:
        watchdog = Watchdog(buffer, {"router": url}, 60, 600, say=print)
        problems = []
        for _ in range(3):
            watchdog.last_health_at = 0.0  # do not wait out the interval
            problems.append(watchdog.check())
    assert problems[0] == ""  # one failed answer is not yet a death
    assert "router is unhealthy" in problems[1] and "rollout loop died" in problems[1]


def test_a_paused_broker_raises_an_alarm_and_the_run_goes_on_after_sigcont(
    buffer: SampleBuffer, start_service, monkeypatch
) -> None:
    monkeypatch.setattr(watchdog_module, "HEALTH_TIMEOUT_S", 0.3)
    broker = start_service("broker", ["broker", "--port", "0"])
    said: list[str] = []
    watchdog = Watchdog(buffer, {"broker": broker.url}, 60, stall_fail_s=3.0, say=said.append)

    def check() -> str:
        watchdog.last_health_at = 0.0  # do not wait out the interval
        watchdog.step_done(1)  # steps go on: only the broker's silence counts here
        return watchdog.check()

    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        assert [check() for _ in range(3)] == ["", "", ""], "a paused service is no death yet"
        assert len(said) == 1 and "broker does not answer" in said[0] and "SIGSTOP" in said[0]
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    assert check() == ""
    assert "broker answers GET" in said[-1] and "again after" in said[-1]
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while not (problem := check()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert problem.startswith("broker has not answered GET"), problem
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)


def test_a_save_folder_that_cannot_be_written_is_refused_before_anything_starts(
    tmp_path: Path, capsys, monkeypatch, toy_model_dir: Path
) -> None:
    """The trainer's first checkpoint may come hours into a run: its folder is tried at the
    start, by tandem up and by the trainer itself."""
    from services.trainer.__main__ import start
    from services.trainer.config import TrainerConfig

    monkeypatch.chdir(tmp_path)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert launcher.main(["--save", str(blocked / "ck")]) == 2
    err = capsys.readouterr().err
    assert f"tandem up: --save {blocked / 'ck'}: cannot write there (Not a directory)" in err
    assert not (tmp_path / "runs").exists(), "nothing started"
    cfg = TrainerConfig(model=str(toy_model_dir), save=str(blocked / "ck"))
    with pytest.raises(ValueError, match=r"--save .*: cannot write there \(Not a directory\)"):
        start(cfg)  # before it asks Redis anything (there is none here)
    cfg = TrainerConfig(model=str(toy_model_dir), save_hf=str(blocked / "hf"))
    with pytest.raises(ValueError, match=r"--save-hf .*/hf: its folder .*: cannot write there"):
        start(cfg)
    monkeypatch.setattr("tandem.up_run.UpRun.run", lambda self: 0)
    assert launcher.main(["--save", str(tmp_path / "new" / "ck")]) == 0
    assert (tmp_path / "new" / "ck").is_dir() and not list((tmp_path / "new" / "ck").iterdir())


def test_a_run_folder_moved_elsewhere_resumes_with_its_own_model_and_checkpoints(
    tmp_path: Path, monkeypatch
) -> None:
    """up_config.json kept --run-dir as given (relative): the moved-folder rule never matched,
    and the resume of a moved toy run failed with `--model .../old/model: no such folder`.
    Folders saved so still resume (their launch folder joined); new ones keep it absolute."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old").mkdir()
    tree, problems = launcher.parse(["--run-dir", "old", "--save", str(tmp_path / "old" / "ck")])
    assert problems == [] and tree is not None
    save_config(tmp_path / "old", tree, str(tmp_path / "old" / "model"))
    saved = json.loads((tmp_path / "old" / "up_config.json").read_text())
    assert saved["run_dir"] == str(tmp_path / "old")
    for kept in (str(tmp_path / "old"), "old"):  # this version's, an older version's
        (tmp_path / "old" / "up_config.json").write_text(json.dumps({**saved, "run_dir": kept}))
        (tmp_path / "old").rename(tmp_path / "new")
        tree, problems = resumed(compose(resume_argv(["--resume", "new"])))
        assert problems == []
        new = (str(tmp_path / "new/model"), str(tmp_path / "new/ck"))
        assert (tree.up.run.model, tree.value("trainer", "save")) == new, kept
        (tmp_path / "new").rename(tmp_path / "old")
    (tmp_path / "old").rename(tmp_path / "new")
    given = resumed(compose(resume_argv(["--resume", "new", "--save", "/data/ck"])))[0]
    assert given.value("trainer", "save") == "/data/ck", "a --save given wins"


def test_a_run_in_the_default_folder_resumes_from_anywhere_with_its_own_model(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """`tandem up` without --run-dir (`make demo`) saved the folder it was launched from as the
    run's, so its resume took the toy model for a moved one, looked for it at
    `runs/X/runs/X/model` and was refused. Folders saved so resume too."""
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr("tandem.up_run.UpRun.run", lambda self: started.append(self) or 0)
    assert launcher.main([]) == 0
    run = started[0].run_dir
    assert run.parent == tmp_path / "runs"
    write_toy_model(run / "model")  # as start_services writes it
    save_config(run, started[0].tree, str(run / "model"))  # as start_services does
    started[0].lock.close()
    saved = json.loads((run / "up_config.json").read_text())
    assert saved["run_dir"] == str(run)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for kept in (str(run), str(tmp_path)):  # this version's, the defect's (the launch folder)
        (run / "up_config.json").write_text(json.dumps({**saved, "run_dir": kept}))
        assert launcher.main(["--resume", str(run)]) == 0, capsys.readouterr().err
        assert started[-1].tree.up.run.model == str(run / "model"), kept
        started[-1].lock.close()


def test_a_resume_of_a_run_that_met_its_accuracy_goal_says_it_would_stop_again(
    tmp_path: Path, capsys
) -> None:
    """It trained 4 more steps of the 300 asked and stopped at the first evaluation."""
    save_config(tmp_path, compose(["--stop-accuracy", "0.9"]), "")
    summary = {"outcome": "reached_accuracy", "accuracy_best": 0.95}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    resumed(compose(resume_argv(["--resume", str(tmp_path), "--max-steps", "300"])))
    assert (
        "the run stopped at its accuracy goal (held-out accuracy 0.95 >= --stop-accuracy 0.9)"
        in (capsys.readouterr().out)
    )
    resumed(compose(resume_argv(["--resume", str(tmp_path), "--stop-accuracy", "0"])))
    assert "accuracy goal" not in capsys.readouterr().out, "a goal given again is the user's"


def test_a_closed_terminal_or_console_pipe_stops_the_run_as_ctrl_c_does() -> None:
    """SIGHUP (an ssh session gone) ended tandem up at once, its summary unwritten; a console
    pipe whose reader left (`tandem up | head`) crashed it at its next line."""
    script = (
        "import os, signal, sys\n"
        "from tandem.run_dir import install_interrupt_handler\n"
        "flag = []\n"
        "install_interrupt_handler(flag)\n"
        "os.kill(os.getpid(), signal.SIGHUP)\n"
        "sys.stderr.write(f'flag after SIGHUP: {flag}\\n')\n"
        "flag.clear()\n"
        "sys.stdout.flush()\n"
        "os.close(1)\n"  # (the pipe's reader is gone: a write fails)
        "print('lost', flush=True)\n"
        "sys.stderr.write(f'flag after a failed write: {flag}\\n')\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert done.returncode == 0, done.stderr
    assert "flag after SIGHUP: [True]" in done.stderr
    assert "flag after a failed write: [True]" in done.stderr
