"""`tandem up --resume RUN_DIR` and what a run folder keeps of its configuration.

Every run folder gets `config.toml` (tandem/up_tree.py `render`: [up] and every service's
table) and `up_config.json`: [up] as the run started (with the model folder actually used, the
folder the run was first started from, `launch_dir`, and the run folder, `run_dir`). A resume
reads config.toml again as its `--config` (a --config file given beside it is laid over it,
table by table), so flags, variables and that file override the saved settings, except the
run terms, which the run's Redis already holds. Paths are saved absolute; a folder moved
elsewhere resumes with its own model and checkpoints (`moved`); a module-form
`--custom-rm-path pkg.mod:fn` that lives in the launch folder is found from there
(`reach_launch_dir`), as it was at the first start. A run folder of the launcher before the
configuration tree (its `--*-args` strings) is refused, naming why.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import pickle
import shutil
import sys
import tempfile
import tomllib
from importlib.machinery import PathFinder
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from proto.run_terms import AGREED
from services.common.settings import ConfigError, flat, leaves, toml_value
from services.trainer.config import TRACKER, saved_iteration
from tandem.run_dir import resume_command
from tandem.up_launch import MODEL_DEFAULTS, UpConfig
from tandem.up_tree import RENDERED, SERVICES, UpTree

CONFIG_FILE = "up_config.json"
RUN_CONFIG = "config.toml"
LAUNCH_DIR = "launch_dir"  # up_config.json's key beside the fields: where the run first started
PROMPTS = "prompts"  # and this one: the training prompts' file and the sha256 of its bytes
# Service settings that name a file or folder, read from the folder a service starts in: saved
# absolute, so that a resume or a repeat of config.toml from another folder finds them.
PATH_KEYS = {"prompt_data", "eval_prompt_data", "load", "ref_load", "tokenizer", "save"}


def resume_argv(argv: list[str]) -> list[str]:
    """`argv` with the run's config.toml as its `--config` when it resumes (`--resume RUN_DIR`),
    a `--config FILE` given beside laid over it (in a temporary file); ConfigError for a folder
    that is no run folder, or one of the launcher before the configuration tree."""
    run_dir = _flag_value(argv, "--resume")
    if not run_dir:
        return argv
    saved, recorded = Path(run_dir) / CONFIG_FILE, Path(run_dir) / RUN_CONFIG
    if not saved.is_file():
        raise ConfigError(
            f"--resume {run_dir}: no {CONFIG_FILE} there (not a tandem up run folder)"
        )
    if "trainer_args" in json.loads(saved.read_text()):
        raise ConfigError(
            f"--resume {run_dir}: the run was made by an older tandem up (its {CONFIG_FILE} "
            "holds --engine-args/--router-args/--trainer-args strings, its config.toml the "
            "services' settings in [up]), which this version cannot read: resume it with the "
            "version that made it, or start a new run"
        )
    tables = _tables(str(recorded)) if recorded.is_file() else {}
    tables.setdefault("up", {})  # [up] as the run resolved it (its defaults by model):
    launch = set(leaves(UpConfig)) - {"model", "resume", "run_dir", "run_id"}
    tables["up"] |= {k: v for k, v in json.loads(saved.read_text()).items() if k in launch}
    given = _flag_value(argv, "--config")
    for name, table in (_tables(given) if given else {}).items():
        tables[name] = {**tables.get(name, {}), **table}
    lines = [f"{RENDERED} (resumed{', with ' + given if given else ''})"]
    for name, table in tables.items():
        lines += [f"[{name}]", *(f"{k} = {toml_value(v)}" for k, v in table.items()), ""]
    # (read by the parse alone: the children get files of their own)
    folder = tempfile.mkdtemp(prefix="tandem-resume-")
    atexit.register(shutil.rmtree, folder, True)
    merged = Path(folder) / RUN_CONFIG
    merged.write_text("\n".join(lines))
    rest = [w for i, w in enumerate(argv) if not _is_config(argv, i)]
    return ["--config", str(merged), *rest]


def _flag_value(argv: list[str], flag: str) -> str:
    found = ""
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith(flag + "="):
            found = word.split("=", 1)[1]
    return found


def _is_config(argv: list[str], i: int) -> bool:
    """Whether argv[i] is `--config`, its value, or `--config=...`."""
    word = argv[i]
    return (
        word == "--config" or word.startswith("--config=") or (i > 0 and argv[i - 1] == "--config")
    )


def _tables(path: str) -> dict[str, dict[str, Any]]:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config {path}: cannot read it as TOML ({exc})") from None


def absolute_paths(tree: UpTree, model: str) -> UpTree:
    """`tree` with `model` (the folder actually used) and the services' files and folders given
    relative to the current folder made absolute (`PATH_KEYS`, a file-form --custom-rm-path)."""
    up = tree.up.model_copy(
        update={"run": tree.up.run.model_copy(update={"model": absolute_path(model)})}
    )
    services = {}
    for name, config in tree.services.items():
        values = flat(config)
        for key in PATH_KEYS & values.keys():
            values[key] = absolute_path(values[key]) if values[key] else values[key]
        if values.get("save"):  # (made at the start: not there yet)
            values["save"] = str(Path(values["save"]).resolve())
        module, colon, fn = str(values.get("custom_rm_path", "")).rpartition(":")
        if module.endswith(".py"):
            values["custom_rm_path"] = f"{absolute_path(module)}{colon}{fn}"
        services[name] = type(config)(**values)
    return UpTree(up, services, tree.origins, tree.config)


def absolute_path(path: str) -> str:
    """`path` made absolute when it names a file or folder from here (else as it is)."""
    return str(Path(path).resolve()) if path and Path(path).exists() else path


def save_config(run_dir: Path, tree: UpTree, model: str) -> None:
    """[up] as the run's `up_config.json`: its fields by key, the model folder used, the
    trainer's checkpoint folder, the folder the run was first started from (kept as it was on
    a resume) and the run folder."""
    path = run_dir / CONFIG_FILE
    launch_dir = json.loads(path.read_text()).get(LAUNCH_DIR) if path.is_file() else None
    saved = flat(tree.up) | {"model": model, "save": tree.value("trainer", "save")}
    # (the defaults that depend on the model, resolved while it still says whether it is the toy)
    saved |= {k: tree.up.by_model(k) for k in MODEL_DEFAULTS.keys() & saved.keys()}
    saved |= {"resume": "", LAUNCH_DIR: launch_dir or os.getcwd()}
    saved["run_dir"] = str(run_dir.absolute())  # (a resume finds a moved folder)
    saved[PROMPTS] = prompts_file(str(tree.value("router", "prompt_data")))
    path.write_text(json.dumps(saved, indent=2))


def prompts_file(path: str) -> dict[str, str]:
    """`path` and the sha256 of its bytes (both "" for the built-in task's prompts)."""
    if not path:
        return {"file": "", "sha256": ""}
    with open(path, "rb") as data:
        return {"file": path, "sha256": hashlib.file_digest(data, "sha256").hexdigest()}


def prompts_changed(saved: dict, tree: UpTree, run_dir: Path) -> str:
    """Why the resume's training prompts are not the run's ("" when they are, or the run
    folder recorded none). They are a run term (`data`: their count and digest as tokenized,
    stated by the router once it has loaded them, minutes in with a real model): other prompts
    would draw the run's next ones from another list. Here, before anything starts, the file's
    bytes are compared (the same file moved is the same prompts)."""
    try:
        now = prompts_file(str(tree.value("router", "prompt_data")))
    except OSError:
        return ""  # (not there or unreadable: the router's check says so)
    was = saved.get(PROMPTS, now)
    if now["sha256"] == was["sha256"]:
        return ""

    def named(prompts: dict[str, str]) -> str:
        if not prompts["file"]:
            return "the built-in task's prompts"
        return f"{prompts['file']} (sha256 of the file {prompts['sha256'][:16]})"

    return (
        f"--resume: --prompt-data is part of the run contract of {run_dir}: the run trains on "
        f"{named(was)}, this resume was given {named(now)}; other prompts would draw the run's "
        "next ones from another list: resume with the run's file as it was, or start a new run"
    )


def resumed(tree: UpTree) -> tuple[UpTree, list[str]]:
    """The tree of a resume (`tree.up.resume`): the run folder, its model and checkpoints
    where they are now, and the problems found (a run term changed, nothing left to train,
    checkpoints gone)."""
    run_dir = Path(tree.up.resume)
    saved = json.loads((run_dir / CONFIG_FILE).read_text())
    problems = [
        f"--resume: {name.replace('_', '-')} is part of the run contract of {run_dir} "
        f"({saved.get(name)!r}); it cannot change on resume (start a new run instead)"
        for name in AGREED
        if name not in ("model", "seed") and name in saved and tree.value("up", name) != saved[name]
    ]
    if problem := prompts_changed(saved, tree, run_dir):
        problems.append(problem)
    if "seed" in saved and tree.up.run.seed != saved["seed"]:
        problems.append(
            f"--resume: --seed orders the run's prompts ({saved['seed']} so far): another "
            "would repeat some and skip others; it cannot change on resume"
        )
    if tree.up.run_dir and Path(tree.up.run_dir).resolve() != run_dir.resolve():
        problems.append(f"--resume {run_dir} is the run folder: leave out --run-dir")
    model, given = moved(saved, run_dir, "model"), tree.up.run.model
    if (
        given
        and tree.origins["up"]["model"] != "file"
        and Path(given).resolve() != Path(model).resolve()
    ):
        problems.append(
            f"--resume: the run trains {model}; --model {given} cannot change on resume "
            "(the checkpoint holds the run's weights; start a new run instead)"
        )
    run = tree.up.run.model_copy(update={"model": model})
    up = tree.up.model_copy(update={"run": run, "run_dir": str(run_dir)})
    tree = UpTree(up, tree.services, tree.origins, tree.config)
    if tree.origins["trainer"]["save"] != "flag" and (save := moved(saved, run_dir, "save")):
        tree.services["trainer"] = SERVICES["trainer"](**(flat(tree.trainer) | {"save": save}))
    router_rm = str(tree.value("router", "custom_rm_path"))
    if router_rm and (found := reach_launch_dir(router_rm, saved.get(LAUNCH_DIR) or "")):
        print(f"[up] {found}", flush=True)
    return tree, problems + checkpoint_problems(tree, run_dir)


def checkpoint_problems(tree: UpTree, run_dir: Path) -> list[str]:
    """A resume with nothing left to train, or whose checkpoints are gone; the note of a goal
    met that would stop the run again (said)."""
    summary, problems = last_summary(run_dir), []
    given = {"stop_accuracy"} if tree.origins["up"]["stop_accuracy"] in ("flag", "env") else set()
    if note := goal_met_note(summary, tree.up.by_model("stop_accuracy"), given):
        print(f"[up] {note}", flush=True)
    checkpoints = Path(tree.value("trainer", "save") or run_dir / "checkpoints")
    every, max_steps = tree.value("trainer", "save_interval"), tree.value("trainer", "max_steps")
    done, trained = steps_saved(checkpoints), steps_recorded(run_dir)
    # (the folder is made at the run's start: gone, not a save that failed, as on a full disk)
    gone = not done and not checkpoints.exists()
    lost = f"trained {trained} steps, saving every --save-interval {every}" if gone else ""
    lost = lost if every and trained >= every else ""
    if not done and (before := saved_before(summary)):  # (a run that ended saved at its end)
        lost = f"saved a checkpoint of step {before}"
    if lost and not tree.value("trainer", "new_lineage"):
        problems.append(
            f"--resume {run_dir}: the run {lost}, but {checkpoints} "
            f"{'is gone' if gone else 'holds none'} (moved or deleted?): give --save the "
            "folder that holds its checkpoints, or start over from --model in this run with "
            "--new-lineage"
        )
    if done >= max_steps:
        problems.append(
            f"--resume {run_dir}: its checkpoint is at step {done}, and --max-steps "
            f"{max_steps} is the run's total: nothing to train; continue it with a "
            f"higher --max-steps ({resume_command(run_dir)} --max-steps {done + max_steps})"
        )
    return problems


def optimizer_used(tree: UpTree, run_dir: Path) -> list[str]:
    """The trainer's optimizer settings made those the run uses when it starts from a
    checkpoint (--load, or the one --save holds: a resume), so that the run folder records
    them: the checkpoint's (`SAVED_OPTIMIZER`), but those given (a flag, a variable, a config
    file, a resume's config.toml; all with --override-opt-param-scheduler) replace them, with
    --override-opt-param-scheduler set. Returns what to say of it (nothing when unchanged)."""
    from services.trainer.config import SAVED_OPTIMIZER, resolve_iteration, saved_optimizer

    ckpt, asked = tree.trainer.checkpoint, flat(tree.trainer)
    save = Path(ckpt.save or run_dir / "checkpoints")  # (the run's own: given per run)
    root = ckpt.load or (str(save) if ckpt.resume and (save / TRACKER).is_file() else "")
    try:
        saved = saved_optimizer(resolve_iteration(root, ckpt.ckpt_step)) if root else {}
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError):
        return []  # (a missing or damaged one: the trainer's check names it)
    everything = ckpt.override_opt_param_scheduler  # (given: every flag wins, as asked)
    used = {
        k: asked[k] if everything or tree.given("trainer", k) else v
        for k, v in saved.items()
        if k in SAVED_OPTIMIZER
    }
    changed = [k for k in used if used[k] != saved[k]]
    override = {"override_opt_param_scheduler": bool(changed) or everything}
    tree.services["trainer"] = SERVICES["trainer"](**(asked | used | override))
    origin = {"flag": "--{}", "env": "its environment variable", "file": "the config file"}
    lines = [
        f"the checkpoint's {k} {saved[k]} -> {used[k]} (from "
        f"{origin.get(tree.origins['trainer'][k], '--{}').format(k.replace('_', '-'))})"
        for k in changed
    ]
    kept = [f"{k} {used[k]} (not the default {asked[k]})" for k in used if used[k] != asked[k]]
    if kept:
        lines.append(f"from the checkpoint: {', '.join(kept)}; a setting given replaces its value")
    return lines


def reach_launch_dir(rm_path: str, launch_dir: str) -> str:
    """For a resume from another folder: when the module of a module-form `rm_path` is not
    found from here but is in `launch_dir`, put that folder first on PYTHONPATH (the router and
    its reward workers inherit it) and on this process's path (the router's check before the
    start); what was done, or "" ."""
    module = rm_path.rpartition(":")[0] or rm_path
    if not launch_dir or module.endswith(".py"):
        return ""
    top = module.split(".")[0]
    try:
        if find_spec(top) is not None:
            return ""
    except (ImportError, ValueError):
        pass
    if PathFinder.find_spec(top, [launch_dir]) is None:
        return ""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [launch_dir, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    sys.path.insert(0, launch_dir)
    return f"--custom-rm-path {rm_path}: {top} is in {launch_dir}, where the run started: on PYTHONPATH"


def steps_saved(checkpoints: Path) -> int:
    """The step of the newest checkpoint in a --save folder (0 when none, or a tracker the
    trainer will name as broken itself)."""
    try:
        return saved_iteration(checkpoints) or 0
    except (OSError, ValueError):
        return 0


def resume_plan(
    checkpoints: Path, run_dir: Path, every: int, one_time: bool, published: int
) -> tuple[bool, int, str]:
    """How a resumed run's trainer goes on: whether from --model as a new lineage (no
    checkpoint, though an earlier trainer published version `published`), the steps trained
    after the newest checkpoint (their weights were not kept: trained again, on the groups they
    trained), and the start-up line saying which ("" when neither). `every`: the trainer's
    --save-interval; `one_time`: --ckpt-step or --new-lineage given (the trainer says which)."""
    if not (checkpoints / TRACKER).is_file():
        note = (
            f"{checkpoints} holds no checkpoint (none saved yet, every --save-interval {every} "
            "steps, or --new-lineage given): the trainer goes on from --model with versions "
            "after the published one (--new-lineage); groups made by the old weights are "
            "dead-lettered (foreign_lineage)"
        )
        return (True, 0, note) if published > 0 else (False, 0, "")
    saved, recorded = steps_saved(checkpoints), steps_recorded(run_dir)
    if recorded <= saved or one_time:
        return False, 0, ""
    steps = f"step {recorded} is" if recorded == saved + 1 else f"steps {saved + 1}-{recorded} are"
    note = (
        f"resuming from the step-{saved} checkpoint in {checkpoints}: {steps} trained again, on "
        f"the groups they trained (weights are kept only by a checkpoint, every --save-interval "
        f"{every} steps)"
    )
    return False, recorded - saved, note


def trainer_start(tree: UpTree, trainer: Any, run_dir: Path, buffer: Any) -> tuple[Any, int]:
    """The trainer's config as its child gets it (`trainer`), with --new-lineage where a resume
    needs it, and the steps it trains again (`resume_plan`, its note said). ChildFailedError
    (exit 2) for what the trainer would refuse once its model is built (`check_start`: a
    damaged checkpoint, a --ckpt-step back without --new-lineage), found before the engines
    start (minutes for a real model) and not after."""
    from services.trainer.config import check_start
    from tandem.sinks import say
    from tandem.supervisor import ChildFailedError

    replayed, max_steps = 0, tree.value("trainer", "max_steps")
    if tree.up.resume:  # (the version an earlier trainer published)
        checkpoints = Path(tree.value("trainer", "save") or run_dir / "checkpoints")
        one_time = tree.given("trainer", "ckpt_step") or tree.given("trainer", "new_lineage")
        every = tree.value("trainer", "save_interval")
        plan = resume_plan(checkpoints, run_dir, every, one_time, buffer.get_version("trainer", 0))
        new_lineage, replayed, note = plan
        if new_lineage:
            trainer = type(trainer)(**(flat(trainer) | {"new_lineage": True}))
        if note:
            say(note)
    try:
        version = check_start(trainer, buffer)
    except (ValueError, FileNotFoundError) as exc:
        raise ChildFailedError(f"trainer: {exc}", 2) from None
    if tree.up.resume and version >= max_steps:  # (it stopped at once: exit 0, untrained)
        raise ChildFailedError(
            f"--resume {run_dir}: the trainer starts a new lineage at version {version} (its "
            f"versions go on after the run's newest, {version - 1}), and "
            f"--max-steps {max_steps} is the run's total: nothing to train; give a "
            f"higher one ({resume_command(run_dir)} --max-steps {version + max_steps})",
            2,
        )
    return trainer, replayed


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
    checkpoints, redis = run_dir / "checkpoints", run_dir / "redis"
    step = 0 if save else steps_saved(checkpoints)  # (--save's own: `checkpoint_refusal`)
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


def checkpoint_refusal(tree: UpTree) -> str:
    """Why a new run (not a resume) cannot start from the checkpoint its trainer would find ("" when it can):
    --save holding one (another run's: a new run's id is new), which the trainer would go on
    from instead of --model; a --load whose iteration --max-steps (the run's last) does not
    pass, so nothing would train."""
    ckpt, max_steps = tree.trainer.checkpoint, tree.value("trainer", "max_steps")
    if ckpt.load:
        step = ckpt.ckpt_step if ckpt.ckpt_step >= 0 else steps_saved(Path(ckpt.load))
        if not step or max_steps > step:
            return ""
        return (
            f"--max-steps {max_steps} is the run's last iteration, and the checkpoint of --load "
            f"{ckpt.load} is at iteration {step}: nothing would train; give --max-steps "
            f"{step + max_steps} to train {max_steps} steps from it"
        )
    if not ckpt.save or not ckpt.resume or not (step := steps_saved(Path(ckpt.save))):
        return ""
    run_dir = Path(ckpt.save).parent  # (the run's folder, where tandem up saved it)
    resume = resume_command(run_dir if (run_dir / CONFIG_FILE).is_file() else "RUN_DIR")
    return (
        f"--save {ckpt.save} holds another run's checkpoint (iteration {step}): a new run would "
        f"go on from it, not from --model. Continue that run with {resume}, start a new one "
        f"from its weights with --load {ckpt.save} instead of --save, or give --save an empty "
        "folder"
    )


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
