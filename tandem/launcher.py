"""`tandem up`: the whole asynchronous RL loop on one machine, every service its own process.

Start order: Redis (unless --redis-url/REDIS_URL) -> engines -> weight broker -> router ->
trainer. The launcher then only watches: it reads the metrics stream from Redis, prints one line
per trainer step, appends every record to `RUN_DIR/metrics.jsonl`, and stops everything when the
held-out accuracy reaches --stop-accuracy, the trainer finishes --max-steps, --time-limit-s
passes, a child dies, or Ctrl-C. Exit code: 0 when the run reached its goal, 2 when a flag, file
or setting is refused before training (the message names it), 130 on Ctrl-C (or SIGTERM, SIGHUP),
1 otherwise. Services talk only over HTTP, Redis and ZMQ, exactly as in a multi-host setup.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import replace
from pathlib import Path

from services.common.config_file import config_path, parse_args
from services.common.flags import config_from_args
from services.rollout_router.config import DataConfig, reward_problem
from services.rollout_router.rollout.tasks import data_problem
from services.sample_buffer import redis_url_problem
from tandem.hub import hub_model
from tandem.up_args import (
    absolute_config,
    conflicts,
    file_fields,
    given_fields,
    join_passthrough,
    resumed_config,
    taken_problem,
)
from tandem.up_services import service_args, trainer_on_gpu
from tandem.up_settings import MODEL_DEFAULTS, UpConfig, build_parser

__all__ = ["MODEL_DEFAULTS", "UpConfig", "build_parser", "main", "parse", "service_args"]


def parse(argv: list[str], prog: str = "tandem up") -> tuple[UpConfig, list[str]]:
    """The resolved configuration of `tandem up ARGV` (flags over variables over --config),
    and the problems found in it; exits 2 on a bad flag or config file, `prog` naming the
    command (`tandem config show` parses the same flags)."""
    parser = build_parser(prog)
    argv = join_passthrough(argv)
    config = config_from_args(UpConfig, parse_args(parser, argv, "up")).settled()
    if problems := unsplittable(config):  # (each string is split again below: a traceback)
        return config, problems
    if config.resume:
        given = given_fields(parser, argv) | file_fields(parser, config_path(argv))
        config, problems = resumed_config(config, given)
        config = config.settled()  # a folder of an older version may lack the settled values
        recorded = Path(config.resume) / "config.toml"  # the services' tables of that run
        if "config" not in given and recorded.is_file():
            config = replace(config, config=str(recorded))
    model, problem = hub_model(config.model)  # ORG/NAME: the Hugging Face cache's copy
    problems += [problem] if problem else []
    # absolute paths (a resume's flags too: its up_config.json is saved again)
    config = absolute_config(replace(config, model=model))
    problems += validate(config, model_named=bool(problem))
    if not problems:
        from services.common.config_file import ConfigError
        from tandem.up_config import render

        try:
            render(config, config.config)
        except ConfigError as exc:
            problems.append(str(exc))
    return config, problems


def main(argv: list[str] | None = None) -> int:
    config, problems = parse(list(sys.argv[1:] if argv is None else argv))
    if problems:
        for problem in problems:
            print(f"tandem up: {problem}", file=sys.stderr)
        return 2
    from services.common.paths import unwritable
    from tandem.run_dir import RunDirBusyError
    from tandem.up_run import UpRun

    # (here, not in `parse`: the check makes the folder, and `tandem config show` parses too)
    if config.save and (problem := unwritable(config.save, "--save")):
        print(f"tandem up: {problem}", file=sys.stderr)
        return 2
    try:
        run = UpRun(config)  # makes the run folder and locks it
    except OSError as exc:
        print(f"tandem up: --run-dir: cannot make {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except RunDirBusyError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    return run.run()


def unsplittable(config: UpConfig) -> list[str]:
    """A pass-through string that is no command line (an unclosed quote), naming its flag."""
    problems = []
    for name in ("engine_args", "router_args", "trainer_args"):
        try:
            shlex.split(getattr(config, name))
        except ValueError as exc:
            flag = "--" + name.replace("_", "-")
            problems.append(f"{flag} {getattr(config, name)!r}: {exc} (quote it as in a shell)")
    return problems


INPUT_KEY = DataConfig().input_key  # the router's, when --input-key is not given


def validate(config: UpConfig, model_named: bool = False) -> list[str]:
    """What is wrong with `config`, each naming its flag (`model_named`: --model's problem is
    said already)."""
    problems = []
    if min(config.num_engines, config.trainer_procs, config.max_steps) < 1:
        problems.append("--num-engines, --trainer-procs and --max-steps must be at least 1")
    model = "" if model_named else config.model
    if model and not Path(model).is_dir():
        problems.append(f"--model {model}: no such folder (a Hugging Face model's)")
    elif model and not (Path(model) / "config.json").exists():
        problems.append(f"--model {model}: no config.json there (expected a HF directory)")
    if not 0 <= config.by_model("stop_accuracy") <= 1:
        problems.append("--stop-accuracy must be within [0, 1] (or -1: the model's default)")
    if not config.resume and config.run_dir:
        own_redis = not config.redis_url
        problems += filter(None, [taken_problem(Path(config.run_dir), config.save, own_redis)])
    if config.redis_url and (
        problem := redis_url_problem(config.redis_url, "--redis-url/REDIS_URL")
    ):
        problems.append(problem)
    if config.stop_timeout_s <= 0 or config.stall_warn_s <= 0:
        problems.append("--stop-timeout-s and --stall-warn-s must be positive")
    counts = config.save_interval, config.keep_checkpoints, config.engine_restarts
    if min(*counts, config.router_restarts, config.broker_restarts) < 0:
        problems.append(
            "--save-interval, --keep-checkpoints, --engine-restarts, --router-restarts and "
            "--broker-restarts must be >= 0"
        )
    own = service_args(config, "run", Path(config.model or "model"), "redis://", passthrough=False)
    passthrough = {
        "engine": config.engine_args,
        "router": config.router_args,
        "trainer": config.trainer_args,
    }
    problems += conflicts(own, passthrough)
    reward_flags = {"--rm-type", "--rm-url", "--custom-rm-path"}  # the router's own count too
    routed = {flag.split("=")[0] for flag in shlex.split(config.router_args)} & reward_flags
    scored = bool(config.rm_type or config.custom_rm_path or config.env_url or routed)
    if problem := reward_problem(config.prompt_data, scored):
        problems.append(problem)
    for flag, data in (
        ("--prompt-data", config.prompt_data),
        ("--eval-prompt-data", config.eval_prompt_data),
    ):
        if problem := data_problem(data, flag, config.input_key or INPUT_KEY):
            problems.append(problem)
    if config.custom_rm_path:  # (the router's module: imported only when there is a path)
        from services.rollout_router.rollout.rewards import import_problem

        if problem := import_problem(config.custom_rm_path):
            problems.append(problem)
    if config.engine_gpus and len(config.engine_gpus) != config.num_engines:
        problems.append(
            f"--engine-gpus names {len(config.engine_gpus)} GPUs for {config.num_engines} "
            "engines (--num-engines): give one per engine"
        )
    if config.engine_device == "cuda" and not config.engine_gpus:
        problems.append("--engine-device cuda needs --engine-gpus (one GPU index per engine)")
    if config.trainer_gpus and len(config.trainer_gpus) < config.trainer_procs:
        problems.append(
            f"--trainer-procs {config.trainer_procs} needs as many --trainer-gpus "
            f"(got {len(config.trainer_gpus)})"
        )
    if (
        config.weight_transport == "nccl"
        and config.engine_device == "cpu"
        and trainer_on_gpu(config)
    ):
        problems.append(
            "--weight-transport nccl with engines on CPU, but the trainer runs on a GPU: NCCL "
            "needs both ends on GPUs (--engine-device cuda --engine-gpus ...), or use "
            "--weight-transport zmq"
        )
    return problems


if __name__ == "__main__":
    sys.exit(main())
