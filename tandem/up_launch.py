"""`tandem up`'s own configuration, the launch section `UpConfig` ([up]): the run folder, the
processes and GPUs, restarts, bounds and the goal, and the run terms (`RunTerms`), once. The
services' settings are their own config classes (tandem/up_tree.py composes them); this module
knows only the launch section and the defaults that depend on the model trained."""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import Field

from proto.run_terms import RunTerms
from services.common.settings import Count, Positive, PositiveSeconds, Section, unless

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
# how the start of a run says the latter). `lr` is the trainer's (taken when not given).
MODEL_DEFAULTS: dict[str, tuple[float, float, str]] = {
    "lr": (1e-3, 1e-6, "learning rate {:g}"),
    "time_limit_s": (900.0, 0.0, "no wall-clock limit"),
    "stop_accuracy": (0.9, 0.0, "no held-out accuracy goal (the run ends at --max-steps)"),
    "startup_timeout_s": (180.0, 900.0, "{:g} s for a service to start"),
    "stall_fail_s": (600.0, 3600.0, "{:g} s without progress"),
}
ByModel = Annotated[float, Field(ge=-1)]  # -1: the model's default (MODEL_DEFAULTS)


class UpConfig(Section):
    """What `tandem up` runs besides the services' own settings. Defaults train the built-in
    toy task to >= 90% in minutes."""

    # (tandem up starts its own Redis unless given one: --redis-url or REDIS_URL; --model's
    # default is the toy model made from --seed)
    run: RunTerms = RunTerms(redis_url="", seed=0)
    run_dir: str = ""
    """Run folder (default: runs/<time>-seed<S>)."""
    resume: str = ""
    """Resume the run in this run folder: the same services, configuration, Redis data and the
    trainer's last checkpoint; flags given beside it (and a --config file's tables) override
    the saved ones (the run terms cannot change)."""
    num_engines: Count = 0
    """Reference engines to start (0 = one per --engine-gpus entry, else 2)."""
    stop_accuracy: Annotated[float, Field(ge=-1, le=1), unless(-1, "model's default", 0)] = -1.0
    """Stop once held-out greedy accuracy reaches this; a run that ends at --max-steps below it
    exits 1 (0 = never: --max-steps is the goal; -1 = 0.9 for the toy model, 0 with a
    --model)."""
    time_limit_s: ByModel = -1.0
    """Limit in seconds on training, counted from the moment every service is up to the stop
    it asks for (start-up and the stop are not counted; 0 = none; -1 = 900 for the toy model,
    none with a --model: a run that makes no progress still ends after --stall-fail-s)."""
    startup_timeout_s: ByModel = -1.0
    """Longest any service may take to start (-1 or 0 = 180 s for the toy model, 900 s with a
    --model: an engine loads its weights and may compile)."""
    engine_restarts: Count = 3
    """Times in a run an engine that exits is started again on its port (its requests go to
    the other engines meanwhile); past that the run ends naming it."""
    router_restarts: Count = 3
    """Times in a run the router, when it exits, is started again on its port (the trainer
    trains on what is buffered meanwhile; its groups in flight are drawn again); past that the
    run ends naming it."""
    broker_restarts: Count = 3
    """Times in a run the weight broker, when it exits, is started again on its port and
    weight intake (engines serve the weights they hold meanwhile); never with
    --weight-transport nccl (its NCCL groups end with it): the run ends naming it."""
    stall_warn_s: PositiveSeconds = 60.0
    """Print what each service waits for after this long without progress."""
    stall_fail_s: ByModel = -1.0
    """End the run (exit 1, with the diagnosis) after this long without progress (no trainer
    step, and no new group in the trainer's hands for its next one; -1 or 0 = 600 s for the toy
    model, 3600 s with a --model: a long response takes a while)."""
    stop_timeout_s: PositiveSeconds = 300.0
    """At the end, how long the services may take to stop (the trainer saves its last
    checkpoint and the trained model then; a real model's save takes minutes) before they are
    killed."""
    engine_gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """GPU index of each engine (CUDA_VISIBLE_DEVICES), one per engine. One GPU for
    everything: --engine-gpus 0 --trainer-gpus 0 (engines and trainer share it; bound the
    engine's memory with --kv-cache-gb N)."""
    trainer_gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """GPUs of the trainer (CUDA_VISIBLE_DEVICES); empty = as inherited; may be the engines'
    GPUs (shared)."""
    trainer_procs: Positive = 1
    """Trainer processes (torchrun); = tensor-parallel x data-parallel size."""
    wandb_project: str = Field(default_factory=lambda: os.environ.get("WANDB_PROJECT", ""))
    """Also log the metrics to this Weights & Biases project (env WANDB_PROJECT; needs the
    wandb package). TensorBoard files are always in RUN_DIR/tensorboard."""

    def settled(self) -> UpConfig:
        """The automatic values made explicit: the engine count, Redis from REDIS_URL."""
        engines = self.num_engines or len(self.engine_gpus) or 2
        redis_url = self.run.redis_url or os.environ.get("REDIS_URL", "")
        run = self.run.model_copy(update={"redis_url": redis_url})
        return self.model_copy(update={"num_engines": engines, "run": run})

    def unset(self, name: str) -> bool:
        """Whether a launch field of MODEL_DEFAULTS was left to its default: below 0, or 0 (no
        bound) but for --time-limit-s and --stop-accuracy, where 0 is no limit or goal."""
        value = getattr(self, name)
        return value < 0 or (value == 0 and name not in ("time_limit_s", "stop_accuracy"))

    def by_model(self, name: str) -> float:
        """A launch field of MODEL_DEFAULTS as given, or its default for the model trained."""
        toy, pretrained, _ = MODEL_DEFAULTS[name]
        return (pretrained if self.run.model else toy) if self.unset(name) else getattr(self, name)


EPILOG = """Every service setting is a flag of tandem up too: bare where one service alone has it
(--prompt-data, --rollout-temperature 0.7, --lr 1e-5, --kv-cache-gb 8), or with its service's
name, which always works (--router.rollout-temperature 0.7; needed where services share a
name: --trainer.num-threads 4). Flags of [up] and the run terms (--model, --seed, the batch
terms, --weight-transport) are tandem up's, filled into every service. --config FILE's [up],
[router], [trainer], [broker] and [engine] tables and TANDEM_<TABLE>_<KEY> variables set the
same keys (`tandem SERVICE --help` lists a service's). tandem up's own defaults for the
trainer: --max-steps 300, --save-interval 10, --keep-checkpoints 2 (its
--keep-last-checkpoints), --lr 1e-3 for the toy model and 1e-6 for a --model, checkpoints in
RUN_DIR/checkpoints; engines on cuda with --engine-gpus (--engine-device: the engine's
--device). --model also takes a hub id (ORG/NAME) the Hugging Face cache holds; default: the
toy model from --seed. `tandem config show [flags]` prints the resolved configuration.
One GPU: tandem up --engine-gpus 0 --trainer-gpus 0 --model DIR (one engine, sharing GPU 0
with the trainer)."""
