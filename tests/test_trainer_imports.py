"""The trainer's first import of megatron-core on a machine without CUDA (`cpu_compat.import_megatron`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys, torch
compile_ = torch.compile
if sys.argv[1] == "trainer":
    from services.trainer.cpu_compat import import_megatron
    import_megatron()
else:
    import megatron.core
from megatron.core import activations
import services.trainer.trainer
had_wandb, dynamo = "wandb" in sys.modules, "torch._dynamo" in sys.modules
import importlib.util
if importlib.util.find_spec("wandb"):
    import wandb  # (a later import of it still works)
print(json.dumps({
    "compiled": hasattr(activations.squared_relu, "_torchdynamo_orig_callable"),
    "wandb": had_wandb,
    "compiler_imported": dynamo,
    "compile_restored": torch.compile is compile_,
}))
"""


def probe(how: str) -> dict[str, bool]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, how], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_megatron_imported_by_the_trainer_on_cpu_compiles_no_kernel_and_skips_wandb() -> None:
    """megatron-core wraps its fused elementwise functions in torch.compile at import (~2.3 s of
    CPU importing torch's compiler, per trainer and convert process; on CPU a C++ compiler at
    their first call) and imports wandb when it is installed (~1 s): the trainer's own fusions
    stay eager on CPU, and the trainer logs nothing to W&B. Nor does the trainer import
    torch's varlen attention (and with it torch._dynamo) before a CUDA call needs it."""
    lean = probe("trainer")
    assert lean == {
        "compiled": False,
        "wandb": False,
        "compile_restored": True,
        "compiler_imported": False,
    }
    plain = probe("plain")  # megatron imported as is: the probe tells the difference
    assert plain["compiled"] and plain["compiler_imported"] and plain["compile_restored"]
