"""What `tandem up` checks of the services' settings before and as they start: each service's
own checks (its config's `validate()` and its config module's `check()`, which read files and
import user code), what no one service can check (settings of two services that only make
sense together), and that the router's longest samples fit the trainer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from proto.contract import SampleLimits
from proto.models import read_config
from services.common.settings import flat
from services.sample_buffer import SampleBuffer
from tandem.supervisor import ChildFailedError
from tandem.up_tree import UpTree, wired

# The services whose `check()` reads the model's files (the toy model is written at the start).
READS_MODEL = {"trainer", "engine"}
# Per-run values of a configuration checked before the run has them.
PLACEHOLDERS = {
    "model": "RUN_DIR/model",
    "redis_url": "redis://STARTED-BY-TANDEM-UP",
    "run_id": "up-RUN",
}


def service_problems(tree: UpTree, run: dict[str, Any] | None = None) -> list[str]:
    """Each service's own checks of its configuration as its child gets it (`run`: the
    per-run values; placeholders before the start): the arithmetic of its `validate()`, and
    its config module's `check()`, which reads files and imports user code; before the toy
    model is written (at the start: checked again then) without the model, and not for the
    services whose check reads it. Each problem names the service."""
    run = run or PLACEHOLDERS | {"model": tree.up.run.model or PLACEHOLDERS["model"]}
    there = Path(run["model"]).is_dir()
    configs = wired(tree, run)[0]
    checked = configs if there else wired(tree, run | {"model": ""})[0]
    dp = max(1, tree.up.trainer_procs // tree.value("trainer", "tensor_model_parallel_size"))
    problems = []
    for name, config in configs.items():
        try:  # (a config without arithmetic of its own has pydantic's classmethod)
            if any("validate" in vars(c) for c in type(config).__mro__ if c is not BaseModel):
                config.validate(dp) if name == "trainer" else config.validate()
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
        check = getattr(importlib.import_module(type(config).__module__), "check", None)
        if check is not None and (there or name not in READS_MODEL):
            problems += [f"{name}: {problem}" for problem in check(checked[name])]
    return problems


def cross_problems(tree: UpTree) -> list[str]:
    """What no one service can check: greedy sampling with a group baseline, an accuracy goal
    the router never measures, trainer processes its tensor-parallel size does not divide."""
    router, trainer = flat(tree.router), flat(tree.trainer)
    goal = unmeasured_goal(tree.up.by_model("stop_accuracy"), router)
    goal = goal or world_problem(tree.up.trainer_procs, trainer)
    problem = greedy_groups(router, trainer) or goal
    return [problem] if problem else []


def greedy_groups(router: dict[str, Any], trainer: dict[str, Any]) -> str:
    """Greedy rollouts (temperature 0, or top_k 1) give a group one response n times: a
    group-relative advantage is then 0 for every sample, and nothing is learned ("": fine)."""
    from services.trainer.config import GROUP_BASELINED

    greedy = router["rollout_temperature"] == 0 or router["rollout_top_k"] == 1
    estimator, n = trainer["advantage_estimator"], trainer["n_samples_per_prompt"]
    if not greedy or n < 2 or estimator not in GROUP_BASELINED:
        return ""
    how = "--rollout-temperature 0" if router["rollout_temperature"] == 0 else "--rollout-top-k 1"
    return (
        f"router: {how} samples greedily: the {n} samples of a prompt are one response, and "
        f"the trainer's --advantage-estimator {estimator} (reward minus the group's mean) gives "
        "each an advantage of 0: nothing would be learned; sample with a temperature > 0 "
        "(--rollout-temperature, or [router])"
    )


def unmeasured_goal(stop_accuracy: float, router: dict[str, Any]) -> str:
    """A held-out accuracy goal the router never measures ("" when it does, or no goal): the
    run said it would stop there and could only end at --max-steps."""
    if stop_accuracy <= 0:
        return ""
    held_out = router["eval_prompt_data"] or router["eval_heldout_fraction"] > 0
    if router["eval_interval"] == 0:
        why, fix = "the router's --eval-interval 0 never evaluates", "an --eval-interval"
    elif router["prompt_data"] and not held_out:
        why = "the router holds no prompts out (no --eval-prompt-data, --eval-heldout-fraction 0)"
        fix = "--eval-prompt-data"
    else:
        return ""
    return (
        f"--stop-accuracy {stop_accuracy:g} is a held-out accuracy goal, but {why}: the run "
        f"could only end at --max-steps; give {fix}, or --stop-accuracy 0 (no goal)"
    )


def world_problem(procs: int, trainer: dict[str, Any]) -> str:
    """Trainer processes that the tensor-parallel size does not divide ("" when it does):
    megatron's RuntimeError traceback once the trainer started, the engines up already."""
    tp = trainer["tensor_model_parallel_size"]
    if procs % tp == 0:
        return ""
    return (
        f"--trainer-procs {procs} is tensor-parallel x data-parallel, and the trainer's "
        f"--tensor-model-parallel-size {tp} does not divide it: give --trainer-procs a "
        f"multiple of {tp} (and as many --trainer-gpus)"
    )


def state_trainer_limits(buffer: SampleBuffer, tree: UpTree, model: Path) -> None:
    """The longest sample the run's trainer takes, written before the router starts: its
    first episodes are cut to it too (the trainer states the same at its start, a few seconds
    later)."""
    trainer, (hf_cfg, _) = flat(tree.trainer), read_config(str(model))
    context = int((hf_cfg.get("text_config") or hf_cfg).get("max_position_embeddings", 4096))
    tokens = min(context, int(trainer["max_tokens_per_gpu"]) + 1)  # (as the trainer's intake)
    buffer.set_limits(SampleLimits(max_tokens=tokens, max_response_len=trainer["max_response_len"]))


def check_sample_fit(info: dict[str, Any], tree: UpTree, say: Callable[[str], None]) -> None:
    """The router's longest samples (its ready file's `longest_prompt` and
    `rollout_max_response_len`) against the run's trainer:
    ChildFailedError when the longer ones would not fit; for environment episodes (their
    prompts grow; the router cuts them where the trainer's limits end) a note when the model's
    context (`context_len`) is larger than the trainer takes."""
    trainer = flat(tree.trainer)
    budget = int(trainer.get("max_tokens_per_gpu", 0)) + 1
    most = int(trainer.get("max_response_len", 0))
    longest, length = info.get("longest_prompt"), info.get("rollout_max_response_len")
    if isinstance(longest, int) and isinstance(length, int):
        if longest + length > budget or length > most:
            raise ChildFailedError(
                f"the router's samples may reach {longest + length} tokens (its longest prompt, "
                f"{longest}, and responses up to {length}: --rollout-max-response-len) and "
                f"the trainer takes at most {budget} in all (--max-tokens-per-gpu {budget - 1}: "
                f"a sample's inputs, every token but its last) and {most} of response "
                "(--max-response-len): the longer ones would be dead-lettered as too_long, never "
                "trained (a bias toward short answers). Raise the trainer's (tandem up "
                f"--max-tokens-per-gpu {longest + length - 1}), or lower "
                "--rollout-max-response-len",
                code=2,  # (a configuration refused, as the services refuse theirs)
            )
    elif isinstance(context := info.get("context_len"), int) and context > budget:
        say(
            f"environment episodes are cut at {budget} tokens, what the trainer takes "
            f"(--max-tokens-per-gpu {budget - 1}), short of the model's context, {context}: "
            "to train longer episodes, raise it (tandem up "
            f"--max-tokens-per-gpu {context - 1})"
        )
