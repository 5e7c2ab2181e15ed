"""Where `tandem up` sends each metrics record besides `metrics.jsonl`: TensorBoard event files
in `RUN_DIR/tensorboard/` (always), and Weights & Biases when the `wandb` package is installed
and a project is named (`--wandb-project` or `WANDB_PROJECT`). A W&B failure is reported once
and W&B is left off: an observer must never end a run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from proto import MetricsRecord
from tandem.tensorboard import EventWriter


def say(message: str) -> None:
    print(f"[up] {message}", flush=True)


class MetricSinks:
    """The W&B run, as the TensorBoard file, is made with the first record: a run refused at
    start-up leaves none of nothing."""

    def __init__(self, run_dir: Path, wandb_project: str, config: dict[str, Any]) -> None:
        self.tensorboard = EventWriter(run_dir / "tensorboard")
        self.run_dir, self.config = run_dir, config
        self.wandb: Any = None
        self.project = wandb_project  # --wandb-project, whose default is env WANDB_PROJECT
        if self.project and importlib.util.find_spec("wandb") is None:
            say(
                f"W&B project {self.project!r} named but the wandb package is not installed: W&B off"
            )
            self.project = ""

    def _open_wandb(self) -> None:
        project, self.project = self.project, ""  # (tried once)
        import wandb

        try:
            self.wandb = wandb.init(
                project=project, name=self.run_dir.name, dir=str(self.run_dir), config=self.config
            )
            say(f"W&B run {self.wandb.url or 'offline, in ' + self.wandb.dir}")
        except Exception as exc:  # wandb raises its own types (login, network): report all
            say(
                f"W&B failed to start ({exc!r}): W&B off for this run (metrics.jsonl and "
                "tensorboard/ have every record). `wandb login` (or WANDB_API_KEY) logs in; "
                "WANDB_MODE=offline keeps the W&B run in RUN_DIR/wandb/ without a login "
                "(`wandb sync` uploads it later)"
            )

    def add(self, record: MetricsRecord) -> None:
        self.tensorboard.add_scalars(record.step, record.values, record.time)
        self.tensorboard.flush()
        if self.project:
            self._open_wandb()
        if self.wandb is not None:
            try:
                self.wandb.log({**record.values, f"{record.source}/step": record.step})
            except Exception as exc:  # as above
                say(f"W&B log failed ({exc!r}): W&B off for the rest of the run")
                self.wandb = None

    def close(self) -> None:
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
