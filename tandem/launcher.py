"""`tandem up`'s entry: its command line resolved into the configuration tree
(tandem/up_tree.py), checked as a whole before anything starts, then run (tandem/up_run.py).

What it checks itself is what no one service can: the launch section's own terms (GPUs and
engines, the run folder, the goal), and settings of two services that only make sense together
(greedy sampling with a group baseline, a goal the router never measures). Each service's
start-up checks that read files or import user code are its config module's `check()`.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from services.common.settings import ConfigError, parser
from services.sample_buffer import redis_url_problem
from tandem.hub import hub_model
from tandem.up_args import absolute_paths, checkpoint_refusal, resume_argv, resumed, taken_problem
from tandem.up_config import cross_problems, service_problems
from tandem.up_launch import DESCRIPTION, EPILOG, UpConfig
from tandem.up_services import trainer_on_gpu
from tandem.up_tree import ALIASES, PER_RUN, RUN_TERMS, SERVICES, UpTree, compose, owner


def help_text(prog: str) -> str:
    """`tandem up --help`: [up]'s flags and the run terms, then each service's own (bare where
    the service alone has the name, else only as --SERVICE.NAME), and how they combine."""
    out = parser(UpConfig, prog, DESCRIPTION)
    text = out.format_help()
    for name, cls in SERVICES.items():
        formatter = out._get_formatter()
        for group in parser(cls, f"{prog} {name}")._action_groups:
            actions = [_shown(a, name) for a in group._group_actions if a.dest not in SKIP]
            if actions:
                formatter.start_section(f"[{name}] {group.title} (each also --{name}.NAME)")
                formatter.add_arguments(actions)
                formatter.end_section()
        text += "\n" + formatter.format_help()
    return f"{text}\n{EPILOG}\n"


SKIP = RUN_TERMS | PER_RUN | {"help", "config"}  # (the run terms are [up]'s; the rest per run)


def _shown(action: argparse.Action, service: str) -> argparse.Action:
    """A service's flag as `tandem up` takes it: its own name where no other service has it,
    else --SERVICE.NAME; with its alias (--engine-device) where it has one."""
    flags = list(action.option_strings)
    try:
        owner(flags[0].removeprefix("--"))
    except ConfigError:  # shared by several services
        flags = [f"--{service}.{f.removeprefix('--')}" for f in flags]
    flags += [
        f"--{a.replace('_', '-')}" for a, at in ALIASES.items() if at == (service, action.dest)
    ]
    return copy.copy(action) if flags == action.option_strings else _renamed(action, flags)


def _renamed(action: argparse.Action, flags: list[str]) -> argparse.Action:
    shown = copy.copy(action)
    shown.option_strings = flags
    return shown


def parse(argv: list[str], prog: str = "tandem up") -> tuple[UpTree | None, list[str]]:
    """The resolved configuration of `tandem up ARGV` and the problems found in it (None and
    the problem when it cannot be resolved); `prog` names the command (`tandem config show`
    parses the same flags). `--help` prints and exits 0."""
    if {"-h", "--help"} & set(argv):
        print(help_text(prog), end="")
        sys.exit(0)
    try:
        tree = compose(resume_argv(argv), prog)
    except ConfigError as exc:
        return None, [str(exc)]
    tree, problems = resumed(tree) if tree.up.resume else (tree, [])
    model, problem = hub_model(tree.up.run.model)  # ORG/NAME: the Hugging Face cache's copy
    problems += [problem] if problem else []
    try:
        tree = absolute_paths(tree, model)  # (a resume from another folder finds them)
    except ConfigError as exc:
        return tree, [*problems, str(exc)]
    problems += validate(tree, model_named=bool(problem))
    if not problems:
        problems += service_problems(tree) or cross_problems(tree)
    return tree, problems


def main(argv: list[str] | None = None) -> int:
    tree, problems = parse(list(sys.argv[1:] if argv is None else argv))
    if problems or tree is None:
        for problem in problems:
            print(f"tandem up: {problem}", file=sys.stderr)
        return 2
    from services.common.paths import unwritable
    from tandem.run_dir import RunDirBusyError
    from tandem.up_run import UpRun

    # (here, not in `parse`: the check makes the folder, and `tandem config show` parses too;
    # the trainer's own check, which reads the model too, runs once the toy model is written)
    save = tree.value("trainer", "save")
    if save and (problem := unwritable(save, "--save")):
        print(f"tandem up: {problem}", file=sys.stderr)
        return 2

    try:
        run = UpRun(tree)  # makes the run folder and locks it
    except OSError as exc:
        print(f"tandem up: --run-dir: cannot make {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except RunDirBusyError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    return run.run()


def validate(tree: UpTree, model_named: bool = False) -> list[str]:
    """What is wrong with the launch section, each naming its flag (`model_named`: --model's
    problem is said already)."""
    up, problems = tree.up, []
    model = "" if model_named else up.run.model
    if model and not Path(model).is_dir():
        problems.append(f"--model {model}: no such folder (a Hugging Face model's)")
    elif model and not (Path(model) / "config.json").exists():
        problems.append(f"--model {model}: no config.json there (expected a HF directory)")
    if tree.given("up", "run_id"):
        problems.append("--run-id is set by tandem up per run (RUN_DIR/redis.json): leave it out")
    if not up.resume:
        save, own_redis = tree.value("trainer", "save"), not up.run.redis_url
        taken = taken_problem(Path(up.run_dir), save, own_redis) if up.run_dir else ""
        problems += filter(None, [taken, checkpoint_refusal(tree)])
    if up.run.redis_url and (
        problem := redis_url_problem(up.run.redis_url, "--redis-url/REDIS_URL")
    ):
        problems.append(problem)
    if up.engine_gpus and len(up.engine_gpus) != up.num_engines:
        problems.append(
            f"--engine-gpus names {len(up.engine_gpus)} GPUs for {up.num_engines} "
            "engines (--num-engines): give one per engine"
        )
    device = tree.value("engine", "device")
    if device == "cuda" and not up.engine_gpus:
        problems.append("--engine-device cuda needs --engine-gpus (one GPU index per engine)")
    if up.trainer_gpus and len(up.trainer_gpus) < up.trainer_procs:
        problems.append(
            f"--trainer-procs {up.trainer_procs} needs as many --trainer-gpus "
            f"(got {len(up.trainer_gpus)})"
        )
    if up.run.weight_transport == "nccl" and device == "cpu" and trainer_on_gpu(tree):
        problems.append(
            "--weight-transport nccl with engines on CPU, but the trainer runs on a GPU: NCCL "
            "needs both ends on GPUs (--engine-device cuda --engine-gpus ...), or use "
            "--weight-transport zmq"
        )
    return problems
