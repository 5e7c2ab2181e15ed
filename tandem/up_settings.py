"""`tandem up`'s own configuration, the launch section: `UpConfig`, its flags (`build_parser`)
and the defaults that depend on the model trained. Knows only its fields; the services'
settings, the resume and the checks of a whole configuration are the launcher's
(tandem/launcher.py)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, replace

from services.common.flags import add_config_args

DESCRIPTION = """`tandem up`: the whole asynchronous RL loop on one machine, every service its own process.

Start order: Redis (unless --redis-url/REDIS_URL) -> engines -> weight broker -> router ->
trainer. The launcher then only watches: it reads the metrics stream from Redis, prints one line
per trainer step, appends every record to `RUN_DIR/metrics.jsonl`, and stops everything when the
held-out accuracy reaches --stop-accuracy, the trainer finishes --max-steps, --time-limit-s
passes, a child dies, or Ctrl-C. Exit code: 0 when the run reached its goal, 2 when a flag, file
or setting is refused before training (the message names it), 130 on Ctrl-C (or SIGTERM, SIGHUP),
1 otherwise. Services talk only over HTTP, Redis and ZMQ, exactly as in a multi-host setup.
"""

# Defaults that depend on the model trained: field -> (the toy model's, a pretrained --model's,
# how the start of a run says the latter).
MODEL_DEFAULTS: dict[str, tuple[float, float, str]] = {
    "lr": (1e-3, 1e-6, "learning rate {:g}"),
    "time_limit_s": (900.0, 0.0, "no wall-clock limit"),
    "stop_accuracy": (0.9, 0.0, "no held-out accuracy goal (the run ends at --max-steps)"),
    "startup_timeout_s": (180.0, 900.0, "{:g} s for a service to start"),
    "stall_fail_s": (600.0, 3600.0, "{:g} s without progress"),
}


@dataclass
class UpConfig:
    """What `tandem up` runs. Defaults train the built-in toy task to >= 90% in minutes."""

    run_dir: str = field(
        default="", metadata={"help": "Run folder (default: runs/<time>-seed<S>)."}
    )
    config: str = field(
        default="",
        metadata={
            "help": "TOML file with a table per command ([up], [router], [trainer], [broker], "
            "[engine]; keys = flag names with underscores); TANDEM_UP_<KEY> variables override "
            "it, flags override both. `tandem config show` prints the result; every run folder "
            "gets it as config.toml (docs/configuration.md)."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed for the model init, data and sampling."})
    model: str = field(
        default="",
        metadata={
            "help": "HF model directory, or a hub id (ORG/NAME) the Hugging Face cache holds "
            "(hf download ORG/NAME); default: the toy model from --seed (cached: ~/.cache/tandem)."
        },
    )
    prompt_data: str = field(
        default="",
        metadata={"help": "Training prompts: JSON lines, a JSON array, .parquet (default: toy)."},
    )
    eval_prompt_data: str = field(
        default="",
        metadata={
            "help": "Held-out prompts of --prompt-data's task (default: a fraction of "
            "--prompt-data, the router's --eval-heldout-fraction)."
        },
    )
    input_key: str = field(
        default="",
        metadata={"help": "Field of a --prompt-data row holding the prompt (default: prompt)."},
    )
    label_key: str = field(
        default="",
        metadata={"help": "Field of a --prompt-data row holding the label (default: label)."},
    )
    rm_type: str = field(
        default="",
        metadata={
            "help": "Built-in reward (the router's --rm-type; default: the toy task's, "
            "reverse_digits; with --prompt-data choose one, or --custom-rm-path).",
            "choices": ["", "reverse_digits", "exact_match", "last_number", "boxed"],
        },
    )
    custom_rm_path: str = field(
        default="",
        metadata={
            "help": "Reward function fn(text, label, stopped): module:fn or path/to/reward.py:fn, "
            "looked up from the current directory."
        },
    )
    env_url: str = field(
        default="", metadata={"help": "Agent environment server: rollouts become its episodes."}
    )
    rollout_max_response_len: int = field(
        default=0,
        metadata={
            "help": "max_new_tokens of a response (0 = the task's: 4 for the toy task, 1024 for "
            "a dataset or an environment; the console says which)."
        },
    )
    save: str = field(
        default="", metadata={"help": "Checkpoint folder (default: RUN_DIR/checkpoints)."}
    )
    num_engines: int = field(
        default=0,
        metadata={"help": "Reference engines to start (0 = one per --engine-gpus entry, else 2)."},
    )
    redis_url: str = field(
        default="", metadata={"help": "Use this Redis instead of starting one (env REDIS_URL)."}
    )
    max_steps: int = field(
        default=300,
        metadata={
            "help": "Trainer steps at most, in all (a resumed run counts the steps it had: "
            "raise it to go on)."
        },
    )
    stop_accuracy: float = field(
        default=-1.0,
        metadata={
            "help": "Stop once held-out greedy accuracy reaches this; a run that ends at "
            "--max-steps below it exits 1 (0 = never: --max-steps is the goal; -1 = 0.9 for "
            "the toy model, 0 with a --model)."
        },
    )
    time_limit_s: float = field(
        default=-1.0,
        metadata={
            "help": "Wall-clock limit of the run in seconds (0 = none; -1 = 900 for the toy "
            "model, none with a --model: a run that makes no progress still ends after "
            "--stall-fail-s)."
        },
    )
    startup_timeout_s: float = field(
        default=-1.0,
        metadata={
            "help": "Longest any service may take to start (-1 or 0 = 180 s for the toy model, "
            "900 s with a --model: an engine loads its weights and may compile)."
        },
    )
    resume: str = field(
        default="",
        metadata={
            "help": "Resume the run in this run folder: the same services, configuration, Redis "
            "data and the trainer's last checkpoint; flags given beside it (and a --config "
            "file's [up] table) override the saved ones (the run contract's terms cannot change)."
        },
    )
    save_interval: int = field(
        default=10,
        metadata={
            "help": "Checkpoint every this many steps into RUN_DIR/checkpoints (0 = only at the "
            "end); the trained model is written to RUN_DIR/trained_model at each save."
        },
    )
    engine_restarts: int = field(
        default=3,
        metadata={
            "help": "Times in a run an engine that exits is started again on its port (its "
            "requests go to the other engines meanwhile); past that the run ends naming it."
        },
    )
    router_restarts: int = field(
        default=3,
        metadata={
            "help": "Times in a run the router, when it exits, is started again on its port "
            "(the trainer trains on what is buffered meanwhile; its groups in flight are drawn "
            "again); past that the run ends naming it."
        },
    )
    broker_restarts: int = field(
        default=3,
        metadata={
            "help": "Times in a run the weight broker, when it exits, is started again on its "
            "port and weight intake (engines serve the weights they hold meanwhile); never "
            "with --weight-transport nccl (its NCCL groups end with it): the run ends naming it."
        },
    )
    keep_checkpoints: int = field(
        default=2,
        metadata={
            "help": "Checkpoints kept in RUN_DIR/checkpoints, the newest (0 = all): a real "
            "model's checkpoint holds its optimizer state, ~14 bytes a parameter."
        },
    )
    stall_warn_s: float = field(
        default=60.0,
        metadata={"help": "Print what each service waits for after this long without progress."},
    )
    stall_fail_s: float = field(
        default=-1.0,
        metadata={
            "help": "End the run (exit 1, with the diagnosis) after this long without progress "
            "(no trainer step, and no new group in the trainer's hands for its next one; -1 or 0 "
            "= 600 s for the toy model, 3600 s with a --model: a long response takes a while)."
        },
    )
    stop_timeout_s: float = field(
        default=300.0,
        metadata={
            "help": "At the end, how long the services may take to stop (the trainer saves its "
            "last checkpoint and the trained model then; a real model's save takes minutes) "
            "before they are killed."
        },
    )
    rollout_batch_size: int = field(default=64, metadata={"help": "Prompts per rollout batch."})
    n_samples_per_prompt: int = field(default=8, metadata={"help": "Samples per prompt (group)."})
    num_steps_per_rollout: int = field(
        default=1, metadata={"help": "Optimizer steps per rollout batch."}
    )
    lr: float = field(
        default=0.0,
        metadata={
            "help": "Trainer learning rate, 0 to 1 (0 = 1e-3 for the toy model, 1e-6 for a --model: "
            "a toy's rate would wreck a pretrained model in a few steps)."
        },
    )
    max_staleness: int = field(
        default=1, metadata={"help": "Versions a sample may lag the trainer before it is dropped."}
    )
    weight_transport: str = field(
        default="zmq",
        metadata={
            "help": "Trainer -> engines weight path: zmq (via the broker) or nccl (broadcast "
            "into the engines' weight group; gloo on CPU).",
            "choices": ["zmq", "nccl"],
        },
    )
    engine_device: str = field(
        default="auto",
        metadata={
            "help": "Device of the engines (auto = cuda with --engine-gpus, else cpu).",
            "choices": ["auto", "cpu", "cuda"],
        },
    )
    engine_gpus: list[int] = field(
        default_factory=list,
        metadata={
            "help": "GPU index of each engine (CUDA_VISIBLE_DEVICES), one per engine. One GPU "
            "for everything: --engine-gpus 0 --trainer-gpus 0 (engines and trainer share it; "
            "bound the engine's memory with --engine-args '--kv-cache-gb N')."
        },
    )
    trainer_gpus: list[int] = field(
        default_factory=list,
        metadata={
            "help": "GPUs of the trainer (CUDA_VISIBLE_DEVICES); empty = as inherited; may be "
            "the engines' GPUs (shared)."
        },
    )
    trainer_procs: int = field(
        default=1,
        metadata={"help": "Trainer processes (torchrun); = tensor-parallel x data-parallel size."},
    )
    engine_args: str = field(
        default="",
        metadata={"help": "Extra flags for `tandem engine`, one quoted string (or [engine])."},
    )
    trainer_args: str = field(
        default="",
        metadata={"help": "Extra flags for `tandem trainer`, one quoted string (or [trainer])."},
    )
    router_args: str = field(
        default="",
        metadata={"help": "Extra flags for `tandem router`, one quoted string (or [router])."},
    )
    wandb_project: str = field(
        default_factory=lambda: os.environ.get("WANDB_PROJECT", ""),
        metadata={
            "help": "Also log the metrics to this Weights & Biases project (env WANDB_PROJECT; "
            "needs the wandb package). TensorBoard files are always in RUN_DIR/tensorboard."
        },
    )

    def settled(self) -> UpConfig:
        """The automatic values made explicit: engine count and device, Redis from REDIS_URL."""
        engines = self.num_engines or len(self.engine_gpus) or 2
        device = self.engine_device
        if device == "auto":
            device = "cuda" if self.engine_gpus else "cpu"
        redis_url = self.redis_url or os.environ.get("REDIS_URL", "")
        return replace(self, num_engines=engines, engine_device=device, redis_url=redis_url)

    def unset(self, name: str) -> bool:
        """Whether a field of MODEL_DEFAULTS was left to its default: below 0, or 0 (no rate or
        bound) but for --time-limit-s and --stop-accuracy, where 0 is no limit or goal."""
        value = getattr(self, name)
        return value < 0 or (value == 0 and name not in ("time_limit_s", "stop_accuracy"))

    def by_model(self, name: str) -> float:
        """A field of MODEL_DEFAULTS as given, or its default for the model trained."""
        toy, pretrained, _ = MODEL_DEFAULTS[name]
        return (pretrained if self.model else toy) if self.unset(name) else getattr(self, name)

    def model_defaults(self) -> str:
        """What a new run with a --model took by default of what depends on the model ("" for
        the toy model, a resume, or none taken)."""
        if not self.model or self.resume:
            return ""
        taken = [name for name in MODEL_DEFAULTS if self.unset(name)]
        if not taken:
            return ""
        whats = ", ".join(MODEL_DEFAULTS[n][2].format(self.by_model(n)) for n in taken)
        flags = ", ".join("--" + n.replace("_", "-") for n in taken)
        return f"{whats} (the defaults for a --model; {flags} set them)"

    def resolved(self, model: str) -> UpConfig:
        """What a run folder saves: the defaults that depend on --model resolved while it still
        says whether the model is the toy one, then the model directory actually used."""
        out = replace(self, model=model, resume="")
        for name in MODEL_DEFAULTS:
            setattr(out, name, self.by_model(name))
        return out


EPILOG = """Every flag can also come from --config FILE's [up] table (and TANDEM_UP_<KEY> variables); the
[router], [trainer], [broker] and [engine] tables configure each service with the keys of
`tandem SERVICE --help`. `tandem config show [flags]` prints the resolved configuration.
One GPU: tandem up --engine-gpus 0 --trainer-gpus 0 --model DIR (one engine, sharing GPU 0
with the trainer)."""


def build_parser(prog: str = "tandem up") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(parser, UpConfig)
    return parser
