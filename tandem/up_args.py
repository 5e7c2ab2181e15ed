"""`tandem up`'s command line beyond one flag per field: pass-through flags and `--resume`.

Pass-through (`--engine-args`, `--router-args`, `--trainer-args`): a value that starts with
`--` is taken as the value in both spellings (`--trainer-args --bf16` and
`--trainer-args=--bf16`). A pass-through flag that `tandem up` itself sets for that service
with another value (the run contract's batch terms, the model, the seed, the learning rate, ...)
is refused before anything starts: two values for one setting is how router and trainer ended
up waiting on each other for good.

Resume: every run folder gets `up_config.json`, the resolved `[up]` configuration (with the
model directory actually used) and the folder the run was first started from (`launch_dir`),
beside `config.toml` (every table, tandem/up_config.py), whose service tables a resumed run's
services read again. `--resume RUN_DIR` starts from it; flags given beside `--resume` override
it, except the run contract's terms, which the run's Redis already holds. Paths are saved
absolute; a module-form `--custom-rm-path pkg.mod:fn` that lives in the launch folder is found
from there (`reach_launch_dir`), as it was at the first start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

from services.common.config_file import options, read_file
from tandem.run_dir import resume_command

PASSTHROUGH = ("--engine-args", "--router-args", "--trainer-args")
# Fields a run folder of an older version lacks, as that version ran them (its config.toml
# holds the service's own key, which tandem up's newer default would contradict).
OLDER_RUNS = {"keep_checkpoints": 0}
CONFIG_FILE = "up_config.json"
LAUNCH_DIR = "launch_dir"  # up_config.json's key beside the fields: where the run first started
# Fields whose value is part of the run contract: fixed for the life of a run.
CONTRACT_FIELDS = (
    "rollout_batch_size",
    "n_samples_per_prompt",
    "num_steps_per_rollout",
    "max_staleness",
    "weight_transport",
    "model",
)


def join_passthrough(argv: list[str]) -> list[str]:
    """`--trainer-args --bf16` -> `--trainer-args=--bf16` (argparse takes a value starting
    with `--` for a flag of its own)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in PASSTHROUGH and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def given_fields(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The config fields the command line names explicitly (not left at their default)."""
    probe = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            kwargs: dict[str, Any] = {"dest": action.dest}
            if isinstance(action, argparse.BooleanOptionalAction):
                kwargs["action"] = argparse.BooleanOptionalAction
            elif action.nargs is not None:
                kwargs["nargs"] = action.nargs
            probe.add_argument(*action.option_strings, **kwargs)
    return set(vars(probe.parse_known_args(argv)[0]))


def file_fields(parser: argparse.ArgumentParser, path: str) -> set[str]:
    """The fields the [up] table of the --config file `path` sets, as given as the flags beside
    --resume are (they were silently overridden by the saved ones); none for a file tandem up
    wrote (a run's config.toml holds every field as that run started, its model "" for the
    toy one: its [up] says nothing new)."""
    if not path or rendered(path):
        return set()
    return set(read_file(path).get("up", {})) & set(options(parser))


RENDERED = "# Resolved by tandem up"  # the first line of a configuration render() wrote


def rendered(path: str) -> bool:
    """`path` is a configuration tandem up wrote (a run's config.toml)."""
    try:
        with open(path, encoding="utf-8") as text:
            return text.readline().startswith(RENDERED)
    except (OSError, UnicodeDecodeError):
        return False


def conflicts(launcher_sets: dict[str, list[str]], passthrough: dict[str, str]) -> list[str]:
    """Problems where a pass-through string sets a flag the launcher sets otherwise.

    `launcher_sets[service]` is the launcher's own argument list for that service;
    `passthrough[service]` the user's string for it."""
    problems = []
    for service, extra in passthrough.items():
        ours = _flag_values(launcher_sets.get(service, []))
        for flag, value in _flag_values(shlex.split(extra)).items():
            if flag in ours and ours[flag] != value:
                problems.append(
                    f"--{service}-args sets {flag} {' '.join(value) or '(on)'} but tandem up "
                    f"gives the {service} {flag} {' '.join(ours[flag]) or '(on)'}: set it once, "
                    f"with tandem up's own flag where it has one (tandem up --help)"
                )
    return problems


def _flag_values(args: list[str]) -> dict[str, list[str]]:
    """`--flag v1 v2` and `--flag=v` -> {"--flag": [values]}."""
    out: dict[str, list[str]] = {}
    flag = None
    for arg in args:
        if arg.startswith("--"):
            flag, _, value = arg.partition("=")
            out[flag] = [value] if value else []
        elif flag is not None:
            out[flag].append(arg)
    return out


def save_config(run_dir: Path, config: Any) -> None:
    """`config` as the run folder's `up_config.json`, with the folder the run was first started
    from (kept as it was on a resume)."""
    path = run_dir / CONFIG_FILE
    launch_dir = json.loads(path.read_text()).get(LAUNCH_DIR) if path.is_file() else None
    saved = {**dataclasses.asdict(config), LAUNCH_DIR: launch_dir or os.getcwd()}
    saved["run_dir"] = str(run_dir.absolute())  # (a resume finds a moved folder)
    saved["trainer_args"] = without_one_time(config.trainer_args)
    path.write_text(json.dumps(saved, indent=2))


# Trainer flags that pick where one launch starts from: saved, they would start every later
# resume of the run there again (--ckpt-step N: back to iteration N each time).
ONE_TIME = {"--ckpt-step": 1, "--new-lineage": 0}


def without_one_time(args: str) -> str:
    """`args` (--trainer-args) without the flags of ONE_TIME and their values (unchanged when
    it has none)."""
    words, kept, skip = shlex.split(args), [], 0
    for word in words:
        flag = word.split("=")[0]
        if skip:
            skip -= 1
        elif flag in ONE_TIME:
            skip = 0 if "=" in word else ONE_TIME[flag]
        else:
            kept.append(word)
    return args if len(kept) == len(words) else shlex.join(kept)


# Service settings that name a file or folder, read from the folder a service starts in: given
# relative (in a --*-args string, or a service table of --config), they are saved absolute, so
# that a resume or a repeat of the run folder's config.toml from another folder finds them.
PATH_KEYS = {"prompt_data", "eval_prompt_data", "load", "ref_load", "tokenizer"}


def absolute_path(path: str) -> str:
    """`path` made absolute when it names a file or folder from here (else as it is)."""
    return str(Path(path).resolve()) if path and Path(path).exists() else path


def absolute_passthrough(args: str) -> str:
    """`args` (a --*-args string) with the value of each flag of PATH_KEYS made absolute (see
    `absolute_path`); the string unchanged when none changes."""
    flags = {"--" + key.replace("_", "-") for key in PATH_KEYS}
    words = shlex.split(args)
    out = []
    for i, word in enumerate(words):
        flag, equals, value = word.partition("=")
        if equals and flag in flags:
            word = f"{flag}={absolute_path(value)}"
        elif i and words[i - 1] in flags and not word.startswith("--"):
            word = absolute_path(word)
        out.append(word)
    return args if out == words else shlex.join(out)


def absolute_config(config: Any) -> Any:
    """`config` (an UpConfig) with its files and folders given relative to the current folder
    made absolute (in the pass-through strings too), so that the run folder's saved
    configuration holds wherever it is resumed from."""
    module, colon, fn = config.custom_rm_path.rpartition(":")
    rm_path = f"{absolute_path(module)}{colon}{fn}" if module.endswith(".py") else ""
    return dataclasses.replace(
        config,
        model=absolute_path(config.model),
        prompt_data=absolute_path(config.prompt_data),
        eval_prompt_data=absolute_path(config.eval_prompt_data),
        custom_rm_path=rm_path or config.custom_rm_path,
        save=str(Path(config.save).resolve()) if config.save else "",
        engine_args=absolute_passthrough(config.engine_args),
        router_args=absolute_passthrough(config.router_args),
        trainer_args=absolute_passthrough(config.trainer_args),
    )


def reach_launch_dir(rm_path: str, launch_dir: str) -> str:
    """For a resume from another folder: when the module of a module-form `rm_path` is not
    found from here but is in `launch_dir`, put that folder first on PYTHONPATH (the router and
    its reward workers inherit it) and on this process's path (the check before the start);
    what was done, or "" ."""
    from services.rollout_router.rollout.rewards import import_problem, split_path

    module = split_path(rm_path)[0]
    if not launch_dir or not module or module.endswith(".py") or not import_problem(rm_path):
        return ""
    top = module.split(".")[0]
    if PathFinder.find_spec(top, [launch_dir]) is None:  # (the lookup import_problem makes)
        return ""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [launch_dir, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    sys.path.insert(0, launch_dir)
    return f"--custom-rm-path {rm_path}: {top} is in {launch_dir}, where the run started: on PYTHONPATH"


def moved(saved: dict[str, Any], run_dir: Path, name: str) -> str:
    """The saved path `name` of a run now in `run_dir`: one inside the folder where the run was
    (its `run_dir`, as given where it started) is taken to have moved with it, unless only the
    path as saved is there (folders of a default --run-dir saved the launch folder as theirs)."""
    value, was = saved.get(name) or "", saved.get("run_dir")
    if not value or not was:
        return value
    was = Path(saved.get(LAUNCH_DIR) or ".", was)  # (an older folder's: as given)
    if not Path(value).is_relative_to(was):
        return value
    here = run_dir.absolute() / Path(value).relative_to(was)
    return value if Path(value).exists() and not here.exists() else str(here)


def resumed_config(config: Any, given: set[str]) -> tuple[Any, list[str]]:
    """The saved configuration of `config.resume`, overridden by the fields in `given`;
    with the problems found (a folder that is no run folder, a contract term changed)."""
    run_dir = Path(config.resume)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return config, [f"--resume {run_dir}: no {CONFIG_FILE} there (not a tandem up run folder)"]
    saved = json.loads(path.read_text())
    problems = [
        f"--resume: {name.replace('_', '-')} is part of the run contract of {run_dir} "
        f"({saved.get(name)!r}); it cannot change on resume (start a new run instead)"
        for name in CONTRACT_FIELDS
        if name in given and name != "model" and getattr(config, name) != saved.get(name)
    ]
    known = {f.name for f in dataclasses.fields(config)}
    merged = {**OLDER_RUNS, **{k: v for k, v in saved.items() if k in known}}
    merged.update({name: getattr(config, name) for name in given})
    model, save = moved(saved, run_dir, "model"), moved(saved, run_dir, "save")
    if "seed" in given and config.seed != saved.get("seed", config.seed):
        problems.append(
            f"--resume: --seed orders the run's prompts ({saved.get('seed')} so far): another "
            "would repeat some and skip others; it cannot change on resume"
        )
    if "run_dir" in given and Path(config.run_dir).resolve() != run_dir.resolve():
        problems.append(f"--resume {run_dir} is the run folder: leave out --run-dir")
    if "model" in given and Path(config.model).resolve() != Path(model).resolve():
        problems.append(
            f"--resume: the run trains {model}; --model {config.model} cannot change on resume "
            "(the checkpoint holds the run's weights; start a new run instead)"
        )
    merged.update(run_dir=str(run_dir), resume=str(run_dir), model=model)
    merged.update({} if "save" in given else {"save": save})
    resumed = type(config)(**merged)
    if resumed.custom_rm_path and (
        found := reach_launch_dir(resumed.custom_rm_path, saved.get(LAUNCH_DIR) or "")
    ):
        print(f"[up] {found}", flush=True)
    summary = last_summary(run_dir)
    if note := goal_met_note(summary, resumed.stop_accuracy, given):
        print(f"[up] {note}", flush=True)
    checkpoints = Path(resumed.save or run_dir / "checkpoints")
    done, trained, every = steps_saved(checkpoints), steps_recorded(run_dir), resumed.save_interval
    # (the folder is made at the run's start: gone, not a save that failed, as on a full disk)
    gone = not done and not checkpoints.exists()
    lost = f"trained {trained} steps, saving every --save-interval {every}" if gone else ""
    lost = lost if every and trained >= every else ""
    if not done and (before := saved_before(summary)):  # (a run that ended saved at its end)
        lost = f"saved a checkpoint of step {before}"
    if lost and "--new-lineage" not in resumed.trainer_args:
        problems.append(
            f"--resume {run_dir}: the run {lost}, but {checkpoints} "
            f"{'is gone' if gone else 'holds none'} (moved or deleted?): give --save the "
            "folder that holds its checkpoints, or start over from --model in this run with "
            "--trainer-args --new-lineage"
        )
    if done >= resumed.max_steps:
        problems.append(
            f"--resume {run_dir}: its checkpoint is at step {done}, and --max-steps "
            f"{resumed.max_steps} is the run's total: nothing to train; continue it with a "
            f"higher --max-steps ({resume_command(run_dir)} --max-steps {done + resumed.max_steps})"
        )
    return resumed, problems


def taken_problem(run_dir: Path, save: str, own_redis: bool) -> str:
    """Why a new run cannot start in `run_dir` ("" when it can): it holds a run (continue it),
    or what one left there without its configuration (checkpoints the trainer would go on from
    instead of --model; with `own_redis`, a Redis whose data the run would read as its own)."""
    if (run_dir / CONFIG_FILE).is_file():
        return (
            f"--run-dir {run_dir} holds a run already: continue it with "
            f"{resume_command(run_dir)}, or give another --run-dir (a new run there would "
            "write over its model and mix with its Redis data and checkpoints)"
        )
    checkpoints, redis = Path(save or run_dir / "checkpoints"), run_dir / "redis"
    step = steps_saved(checkpoints)
    left = [f"{checkpoints} (step {step})"] if step else []
    left += [str(redis)] if own_redis and redis.is_dir() and any(redis.iterdir()) else []
    if not left:
        return ""
    return (
        f"--run-dir {run_dir} holds what an earlier run left, without its {CONFIG_FILE}: "
        f"{' and '.join(left)}; a new run would go on from them (the trainer from the checkpoint, "
        "not --model; Redis with the old run's samples): move or delete them, or give another "
        "--run-dir"
    )


def steps_saved(checkpoints: Path) -> int:
    """The step of the newest checkpoint in a --save folder (0 when none, or a tracker the
    trainer will name as broken itself)."""
    from services.trainer.lineage import saved_iteration

    try:
        return saved_iteration(checkpoints) or 0
    except (OSError, ValueError):
        return 0


def last_summary(run_dir: Path) -> dict[str, Any]:
    """The run's summary.json as its last launch left it ({} when there is none to read)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def saved_before(summary: dict[str, Any]) -> int:
    """The step of the checkpoint the run's last launch left (`last_summary`; 0: none)."""
    try:
        return int(summary.get("checkpoint_step") or 0)
    except (ValueError, TypeError):
        return 0


def goal_met_note(summary: dict[str, Any], stop_accuracy: float, given: set[str]) -> str:
    """A resume of a run that stopped at its accuracy goal (`last_summary`), with that goal
    still set (not given again): it would stop at its first evaluation again ("" otherwise)."""
    best = summary.get("accuracy_best")
    reached = summary.get("outcome") == "reached_accuracy" and "stop_accuracy" not in given
    if not reached or not isinstance(best, int | float) or stop_accuracy <= 0:
        return ""
    if best < stop_accuracy:  # (stop_accuracy -1: an older folder's)
        return ""
    return (
        f"the run stopped at its accuracy goal (held-out accuracy {best:.2f} >= --stop-accuracy "
        f"{stop_accuracy:g}): it stops again at the first evaluation that reaches it; to train "
        "on, give --stop-accuracy 0 (no goal) or a higher one"
    )


def resume_plan(
    checkpoints: Path, run_dir: Path, config: Any, published: int
) -> tuple[bool, int, str]:
    """How a resumed run's trainer goes on: whether from --model as a new lineage (no
    checkpoint, though an earlier trainer published version `published`), the steps trained
    after the newest checkpoint (their weights were not kept: trained again, on the groups they
    trained), and the start-up line saying which ("" when neither)."""
    from services.trainer.lineage import TRACKER

    every = config.save_interval
    if not (checkpoints / TRACKER).is_file():
        note = (
            f"{checkpoints} holds no checkpoint (none saved yet, every --save-interval {every} "
            "steps, or --new-lineage given): the trainer goes on from --model with versions "
            "after the published one (--new-lineage); groups made by the old weights are "
            "dead-lettered (foreign_lineage)"
        )
        return (True, 0, note) if published > 0 else (False, 0, "")
    saved, recorded = steps_saved(checkpoints), steps_recorded(run_dir)
    if recorded <= saved or without_one_time(config.trainer_args) != config.trainer_args:
        # (--trainer-args --ckpt-step picks another checkpoint: the trainer says which)
        return False, 0, ""
    steps = f"step {recorded} is" if recorded == saved + 1 else f"steps {saved + 1}-{recorded} are"
    note = (
        f"resuming from the step-{saved} checkpoint in {checkpoints}: {steps} trained again, on "
        f"the groups they trained (weights are kept only by a checkpoint, every --save-interval "
        f"{every} steps)"
    )
    return False, recorded - saved, note


def trainer_start(
    args: list[str], config: Any, run_dir: Path, buffer: Any
) -> tuple[list[str], int]:
    """The trainer's command line (`args`), with --new-lineage where a resume needs it, and the
    steps it trains again (`resume_plan`, its note said). ChildFailedError (exit 2) for what
    the trainer would refuse once its model is built (`check_start`: a damaged checkpoint, a
    --ckpt-step back without --new-lineage), found before the engines start (minutes for a
    real model) and not after."""
    from services.common.config_file import parse_args
    from services.common.flags import config_from_args
    from services.trainer.__main__ import build_parser, check_start
    from services.trainer.config import TrainerConfig
    from tandem.sinks import say
    from tandem.supervisor import ChildFailedError

    replayed = 0
    if config.resume:  # (the version an earlier trainer published)
        checkpoints = Path(config.save or run_dir / "checkpoints")
        plan = resume_plan(checkpoints, run_dir, config, buffer.get_version("trainer", 0))
        new_lineage, replayed, note = plan
        args = [*args, "--new-lineage"] if new_lineage else args
        if note:
            say(note)
    trainer = config_from_args(TrainerConfig, parse_args(build_parser(), args[1:], "trainer"))
    try:
        version = check_start(trainer, buffer)
    except (ValueError, FileNotFoundError) as exc:
        raise ChildFailedError(f"trainer: {exc}", 2) from None
    if config.resume and version >= config.max_steps:  # (it stopped at once: exit 0, untrained)
        raise ChildFailedError(
            f"--resume {run_dir}: the trainer starts a new lineage at version {version} (its "
            f"versions go on after the run's newest, {version - 1}), and "
            f"--max-steps {config.max_steps} is the run's total: nothing to train; give a "
            f"higher one ({resume_command(run_dir)} --max-steps {version + config.max_steps})",
            2,
        )
    return args, replayed


def steps_recorded(run_dir: Path) -> int:
    """The last trainer step in a run folder's metrics.jsonl (0: none)."""
    from tandem.progress import metrics_rows

    rows = metrics_rows(run_dir)
    return max((int(r.get("step", 0)) for r in rows if r.get("source") == "trainer"), default=0)


def lost_history(counters: dict[str, int]) -> str:
    """What a resume says when its Redis (`counters`) holds none of the run's history: its
    data was deleted or lost ("" when it holds some)."""
    if counters.get("groups_generated"):
        return ""
    return (
        "--resume: the run's Redis holds none of its history (its data deleted or lost): the "
        "ledger, the drop log and the prompt order start over; the trainer goes on from its "
        "checkpoint"
    )


def stopped_early(step: int, max_steps: int, run_dir: Path) -> str:
    """The trainer exited 0 before --max-steps: stopped by a signal tandem up did not send."""
    return (
        f"FAILED: the trainer stopped at step {step} of --max-steps {max_steps} (exit 0: a "
        "signal tandem up did not send: a scheduler, docker stop, kill?); its last checkpoint "
        f"holds the run: {resume_command(run_dir)} goes on"
    )
