"""`services.trainer.convert` (the `tandem convert` command): HF -> megatron checkpoint -> HF."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_trainer_hf_convert import (  # noqa: F401 - fixtures
    hf_logits,
    megatron_world,
    qwen2_tied_dir,
    tiny_dirs,
)

IDS = torch.tensor([[1, 5, 6, 14, 6, 5, 2, 7, 8, 9, 3]])


def convert(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "services.trainer.convert", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "which", ["toy_llama", "qwen2_tied_bias", "qwen3_tied", "mistral", "qwen3_moe"]
)
def test_hf_to_megatron_and_back_round_trips_tensors_and_logits(
    toy_model_dir: Path,
    qwen2_tied_dir: Path,  # noqa: F811 - the imported fixture
    tiny_dirs: dict[str, Path],  # noqa: F811 - the imported fixture
    tmp_path: Path,
    which: str,
) -> None:
    from safetensors.torch import load_file

    src = {"toy_llama": toy_model_dir, "qwen2_tied_bias": qwen2_tied_dir, **tiny_dirs}[which]
    ckpt, out = tmp_path / "mcore", tmp_path / "hf"
    done = convert("hf-to-megatron", "--hf-dir", str(src), "--save", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "0"
    done = convert("megatron-to-hf", "--load", str(ckpt), "--out", str(out), "--hf-dir", str(src))
    assert done.returncode == 0, done.stderr[-3000:]
    original, back = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    if which in ("qwen2_tied_bias", "qwen3_tied"):  # tied: HF may store lm_head; we never do
        original.pop("lm_head.weight", None)
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    ids = IDS.clamp(max=15)
    assert torch.equal(hf_logits(out, ids), hf_logits(src, ids))


def test_megatron_logits_from_a_converted_checkpoint_equal_transformers_logits(
    megatron_world: None,  # noqa: F811 - the imported fixture
    toy_model_dir: Path,
    tmp_path: Path,
) -> None:
    from megatron.core import dist_checkpointing

    from services.trainer import hf_convert

    done = convert("hf-to-megatron", "--hf-dir", str(toy_model_dir), "--save", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    arch = hf_convert.read_hf_arch(toy_model_dir)
    model = hf_convert.build_gpt_model(arch, hf_convert.transformer_config(arch), 128)
    loaded = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, str(tmp_path / "iter_0000000")
    )
    model.load_state_dict(loaded["model"])
    with torch.no_grad():
        logits = model(
            input_ids=IDS, position_ids=torch.arange(IDS.shape[1])[None], attention_mask=None
        )
    diff = (logits[..., : arch.vocab_size] - hf_logits(toy_model_dir, IDS)).abs().max().item()
    assert diff < 1e-5


def test_convert_names_the_missing_tracker_and_the_flag_of_a_model_that_is_not_there(
    tmp_path: Path,
) -> None:
    done = convert("megatron-to-hf", "--load", str(tmp_path), "--out", str(tmp_path / "o"))
    assert done.returncode == 2
    assert "latest_checkpointed_iteration.txt" in done.stderr
    done = convert("hf-to-megatron", "--hf-dir", str(tmp_path), "--save", str(tmp_path / "c"))
    assert done.returncode == 2
    assert "config.json not found: --hf-dir must be a Hugging Face model directory" in done.stderr


def test_convert_names_an_output_it_cannot_write_before_any_work(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = convert("hf-to-megatron", "--hf-dir", str(tmp_path), "--save", str(blocker / "c"))
    assert done.returncode == 2
    assert f"--save {blocker / 'c'}: cannot write there" in done.stderr.splitlines()[-1]
    done = convert("megatron-to-hf", "--load", str(tmp_path), "--out", str(blocker / "o"))
    assert done.returncode == 2
    assert f"--out {blocker / 'o'}: its folder {blocker}: cannot write" in done.stderr


def test_the_trainer_starts_from_a_converted_checkpoint(
    buffer, toy_model_dir: Path, tmp_path: Path
) -> None:
    """--load of other weights (same architecture) replaces the --model weights; bf16 weights
    (as most models are published) are converted in bf16 (the old code built and wrote fp32:
    twice the memory and the disk) and load into an fp32 trainer."""
    import json

    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint import FileSystemReader

    from tandem.toy_model import write_toy_model
    from tests.test_trainer_process import common_args, run_trainer, sample_groups

    other = write_toy_model(tmp_path / "other", seed=1)
    weights = other / "model.safetensors"
    save_file({k: v.bfloat16() for k, v in load_file(weights).items()}, weights)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    done = convert("hf-to-megatron", "--hf-dir", str(other), "--save", str(tmp_path / "c"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"into a llama model of [\d,]+ parameters, bf16 \(\d+ s\)", done.stdout)
    stored = FileSystemReader(str(tmp_path / "c" / "iter_0000000")).read_metadata()
    dtypes = {
        m.properties.dtype for m in stored.state_dict_metadata.values() if hasattr(m, "properties")
    }
    assert dtypes == {torch.bfloat16}, dtypes
    for g in sample_groups(other, 4, 4, seed=12):  # engine log-probs of the *other* weights
        buffer.put_group(g)
    done = run_trainer(
        [*common_args(toy_model_dir, buffer), "--max-steps", "1", "--load", str(tmp_path / "c")]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    values = next(r.values for _, r in buffer.read_metrics() if r.source == "trainer")
    assert values["train/logprob_abs_diff_max"] < 1e-3
    assert buffer.get_version("trainer") == 1


def test_megatron_to_hf_copies_the_source_models_tokenizer_or_warns_naming_hf_dir(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    import shutil

    src, ckpt = tmp_path / "src", tmp_path / "mcore"
    shutil.copytree(toy_model_dir, src)
    done = convert("hf-to-megatron", "--hf-dir", str(src), "--save", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    done = convert("megatron-to-hf", "--load", str(ckpt), "--out", str(tmp_path / "with"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "with" / "tokenizer.json").read_bytes() == (
        src / "tokenizer.json"
    ).read_bytes()
    assert "no tokenizer files copied" not in done.stderr

    shutil.rmtree(src)  # the source model moved away: no tokenizer, and a warning saying so
    done = convert("megatron-to-hf", "--load", str(ckpt), "--out", str(tmp_path / "without"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "without" / "tokenizer.json").exists()
    assert "no tokenizer files copied" in done.stderr and "--hf-dir" in done.stderr


def test_convert_names_a_checkpoint_whose_files_are_cut_short(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "mcore"
    done = convert("hf-to-megatron", "--hf-dir", str(toy_model_dir), "--save", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    for shard in (ckpt / "iter_0000000").glob("*.distcp"):
        os.truncate(shard, 100)
    done = convert("megatron-to-hf", "--load", str(ckpt), "--out", str(tmp_path / "hf"))
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"tandem convert: error: checkpoint {ckpt / 'iter_0000000'} does not load"
    )
    assert "no older checkpoint is there" in last and "Traceback" not in done.stderr


def test_a_model_is_written_in_the_dtype_its_config_states(tmp_path: Path) -> None:
    """A bf16 model trained in fp32 (on a CPU) was written in fp32 under a config saying
    bfloat16: twice the disk, and not what the config tells a loader."""
    from safetensors.torch import load_file

    from services.trainer.convert import write_hf_dir

    tensors = {"w": torch.randn(4, 4), "steps": torch.arange(3)}
    for stated, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        out = write_hf_dir(tensors, f'{{"dtype": "{stated}"}}', str(tmp_path / stated), "")
        written = load_file(out / "model.safetensors")
        assert written["w"].dtype == dtype and torch.equal(written["w"], tensors["w"].to(dtype))
        assert written["steps"].dtype == torch.int64, stated
    out = write_hf_dir(tensors, '{"torch_dtype": "bfloat16"}', str(tmp_path / "older"), "")
    assert load_file(out / "model.safetensors")["w"].dtype == torch.bfloat16
    out = write_hf_dir(tensors, "{}", str(tmp_path / "unstated"), "")
    assert load_file(out / "model.safetensors")["w"].dtype == torch.float32


TINY_QWEN2 = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
TINY_QWEN2 |= {"num_key_value_heads": 2, "vocab_size": 300, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def sharded_qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a bf16 Qwen2-shaped model in 3 shards with its index, as published; its checkpoint)."""
    from bench.convert_memory import QWEN2_05B, write_sharded_model

    root = tmp_path_factory.mktemp("sharded")
    write_sharded_model(root / "hf", {**QWEN2_05B, **TINY_QWEN2}, shards=3)
    done = convert("hf-to-megatron", "--hf-dir", str(root / "hf"), "--save", str(root / "ckpt"))
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "hf", root / "ckpt"


def test_a_sharded_bf16_model_round_trips_bit_exactly(
    sharded_qwen2: tuple[Path, Path], tmp_path: Path
) -> None:
    """What bench/convert_memory.py measures: the tensors come back bit for bit, in one file
    byte for byte as safetensors' own save_file writes it."""
    from safetensors.torch import load_file, save_file

    src, ckpt = sharded_qwen2
    done = convert("megatron-to-hf", "--load", str(ckpt), "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-3000:]
    original = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    back = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    save_file(original, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    written = (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert written == (tmp_path / "ref.safetensors").read_bytes()


def test_a_model_over_the_shard_bound_is_written_in_shards_with_their_index(
    sharded_qwen2: tuple[Path, Path], tmp_path: Path
) -> None:
    """megatron-to-hf wrote one model.safetensors whatever the model's size (a 32B model: one
    64 GB file, which the Hub refuses). Files hold at most MAX_SHARD_BYTES of tensors, as HF
    writes them, with the index naming each tensor's file; transformers loads the folder."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from services.trainer.convert import write_hf_dir

    src, _ckpt = sharded_qwen2
    original = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    total = sum(t.numel() * t.element_size() for t in original.values())
    bound = total // 3
    out = write_hf_dir(original, (src / "config.json").read_text(), str(tmp_path / "hf"), "", bound)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(f.name for f in out.glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    assert index["metadata"]["total_size"] == total and set(index["weight_map"].values()) == set(
        files
    )
    for name in files:
        held = load_file(out / name)
        assert sum(t.numel() * t.element_size() for t in held.values()) <= bound
        assert all(
            index["weight_map"][k] == name and torch.equal(t, original[k]) for k, t in held.items()
        )
    assert set(index["weight_map"]) == set(original)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    assert set(original) <= set(loaded)
    assert all(torch.equal(loaded[k], original[k]) for k in original)
    # under the bound: one file, no index (as before)
    one = write_hf_dir(original, (src / "config.json").read_text(), str(tmp_path / "one"), "")
    assert sorted(f.name for f in one.iterdir()) == ["config.json", "model.safetensors"]


class Counting(dict):
    """HF tensors by name that count how many of those handed out are alive at most."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.alive: set[int] = set()
        self.most = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        import weakref

        t = super().__getitem__(name).clone()
        self.alive.add(id(t))
        weakref.finalize(t, self.alive.discard, id(t))
        self.most = max(self.most, len(self.alive))
        return t


def test_hf_weights_go_into_the_model_and_out_of_it_a_layer_at_a_time(
    megatron_world: None,  # noqa: F811 - the imported fixture
    sharded_qwen2: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    """Reading every HF tensor first, then every megatron tensor made of them, held the
    model's weights three times over (a 7B bf16 model: ~45 GB); now one layer's are held
    beyond the model. The export writes views of the parameters a tensor at a time."""
    from safetensors.torch import load_file

    from services.trainer import hf_convert
    from services.trainer.convert import write_hf_dir

    src, _ = sharded_qwen2
    arch = hf_convert.read_hf_arch(src)
    model = hf_convert.build_gpt_model(arch, hf_convert.transformer_config(arch, bf16=True), 128)
    hf = Counting({k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()})
    hf_convert.load_hf_into_model(model, arch, hf)
    assert hf.most <= 4, hf.most  # (of 2 * 15 + 2: q, k and v, and the tensor before them)
    full = {name: p.detach() for name, p in model.named_parameters()}
    made = Counting({})

    def tensors() -> object:
        for name, view in hf_convert.megatron_full_to_hf(arch, full):
            made[name] = view
            yield name, made[name]

    write_hf_dir(tensors, (src / "config.json").read_text(), str(tmp_path / "out"), "")
    assert made.most <= 2, made.most
    back = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(back[k], v) for k, v in hf.items())


def bad_model(src: Path, folder: Path, case: str) -> str:
    """A copy of `src` spoilt as `case` says; returns what the error must name."""
    import json
    import shutil

    shutil.copytree(src, folder)
    shard, config = folder / "model-00002-of-00003.safetensors", folder / "config.json"
    cfg = json.loads(config.read_text())
    if case == "shard cut short":
        os.truncate(shard, shard.stat().st_size // 2)
        return f"{shard} holds {shard.stat().st_size} bytes, its header says"
    if case == "shard of 4 bytes":
        os.truncate(shard, 4)
        return f"{shard}: not a safetensors file (4 bytes)"
    if case == "no index, a shard missing":
        (folder / "model.safetensors.index.json").unlink()
        shard.unlink()
        return f"{folder} holds no tensor model."
    if case == "no weights":
        for f in folder.glob("model*"):
            f.unlink()
        return f"no *.safetensors in {folder}: --hf-dir needs"
    if case == "config not JSON":
        config.write_text('{"model_type": ')
        return f"{config} is not JSON"
    if case == "config a list":
        config.write_text("[1, 2]")
        return f"{config} holds a list"
    if case == "config without fields":
        config.write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "bfloat16"}))
        return f"{config}: no vocab_size"
    if case == "a size a string":
        config.write_text(json.dumps({**cfg, "hidden_size": "64"}))
        return f"{config}: hidden_size is '64', not a positive integer"
    assert case == "weights of another shape"
    config.write_text(json.dumps({**cfg, "intermediate_size": 256}))
    return f"{folder}: the weights do not fit the architecture of its config.json"


@pytest.mark.parametrize(
    "case",
    [
        "shard cut short",
        "shard of 4 bytes",
        "no index, a shard missing",
        "no weights",
        "config not JSON",
        "config a list",
        "config without fields",
        "a size a string",
        "weights of another shape",
    ],
)
def test_a_bad_hf_model_is_named_exit_2_and_leaves_no_checkpoint(
    megatron_world: None,  # noqa: F811 - the imported fixture
    sharded_qwen2: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
) -> None:
    """Each was a traceback (exit 1) or an error naming no file ('num_attention_heads',
    'Expecting value', --model for a flag convert does not have)."""
    from services.trainer.convert import main

    wanted = bad_model(sharded_qwen2[0], tmp_path / "bad", case)
    save = tmp_path / "ckpt"
    assert main(["hf-to-megatron", "--hf-dir", str(tmp_path / "bad"), "--save", str(save)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tandem convert: error: ") and wanted in err, err
    assert not save.exists()


def test_convert_writes_over_nothing_and_names_a_load_folder_it_cannot_read(
    megatron_world: None,  # noqa: F811 - the imported fixture
    sharded_qwen2: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An existing --out was replaced whatever it held (a folder of other files, the source
    model itself: deleted), a --save holding a run's checkpoints got the converted weights
    under its tracker; a tracker that holds no number, a checkpoint without common.pt said
    'invalid literal for int()' and gave a traceback."""
    import shutil

    from services.trainer.convert import main

    src, ckpt = sharded_qwen2
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    (tmp_path / "a-file").write_text("keep")
    cases = {
        ("megatron-to-hf", "--load", str(ckpt), "--out", str(other)): f"--out {other}: exists",
        ("megatron-to-hf", "--load", str(ckpt), "--out", str(src)): f"--out {src}: exists",
        ("megatron-to-hf", "--load", str(ckpt), "--out", str(tmp_path / "a-file")): "is a file",
        ("hf-to-megatron", "--hf-dir", str(src), "--save", str(ckpt)): f"--save {ckpt}: holds a",
    }
    before = {p: p.read_bytes() for p in [*src.iterdir(), *ckpt.rglob("*")] if p.is_file()}
    for args, wanted in cases.items():
        assert main(list(args)) == 2, args
        assert wanted in capsys.readouterr().err, args
    assert (other / "notes.txt").read_text() == (tmp_path / "a-file").read_text() == "keep"
    assert all(p.read_bytes() == data for p, data in before.items())

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "latest_checkpointed_iteration.txt").write_text("abc")
    assert main(["megatron-to-hf", "--load", str(broken), "--out", str(tmp_path / "o1")]) == 2
    assert (
        "latest_checkpointed_iteration.txt holds 'abc', not an iteration" in capsys.readouterr().err
    )
    (broken / "latest_checkpointed_iteration.txt").write_text("0")
    (broken / "iter_0000000" / "common.pt").unlink()
    assert main(["megatron-to-hf", "--load", str(broken), "--out", str(tmp_path / "o2")]) == 2
    assert "common.pt is missing" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
