"""The one settings loader (services/common/settings.py) on the services' own config trees:
precedence, where each value came from, refusals named as the user gave the value, a resolved
config written to TOML and read back, and --help from the fields' docstrings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.settings import ConfigError, leaves, load, parser, resolve, to_toml
from services.engine.config import EngineConfig
from services.rollout_router.config import RouterConfig
from services.trainer.config import TrainerConfig
from services.weight_broker.config import BrokerConfig

CONFIGS = {"router": RouterConfig, "trainer": TrainerConfig, "broker": BrokerConfig}
CONFIGS["engine"] = EngineConfig


def test_a_flag_beats_a_variable_which_beats_the_file_which_beats_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[trainer]\nlr = 0.25\nseed = 3\nmax_steps = 9\n[trainer.loss]\ngamma = 0.5\n")
    monkeypatch.setenv("TANDEM_TRAINER_SEED", "4")
    monkeypatch.setenv("TANDEM_TRAINER_MAX_STEPS", "7")
    argv = ["--config", str(path), "--max-steps", "5"]
    config, origins = resolve(TrainerConfig, argv, "trainer")
    assert (config.optimizer.lr, config.run.seed, config.batch.max_steps) == (0.25, 4, 5)
    assert config.loss.gamma == 0.5 and config.optimizer.min_lr == 0.0
    assert (origins["lr"], origins["seed"], origins["max_steps"]) == ("file", "env", "flag")
    assert origins["gamma"] == "file" and origins["min_lr"] == "default"


def test_a_section_default_of_a_service_stays_when_a_neighbouring_key_is_given() -> None:
    broker = load(BrokerConfig, ["--port", "0", "--run-id", "r"], "broker")
    assert (broker.serve.port, broker.serve.max_request_bytes) == (0, 1 << 20)
    assert broker.run.redis_url == "", "the broker publishes nowhere unless told"
    router = RouterConfig(max_buffer_depth=5, rollout=False)  # a leaf named as its section
    assert (router.rollout.rollout, router.rollout.max_buffer_depth) == (False, 5)


@pytest.mark.parametrize(
    ("argv", "env", "table", "said"),
    [
        (["--lr", "2"], {}, "", "--lr 2: must be at most 1"),
        (["--num-threads", "0"], {}, "", "--num-threads 0: must be at least 1"),
        (["--seed", "x"], {}, "", "--seed x: Input should be a valid integer"),
        ([], {"TANDEM_TRAINER_LR": "nan"}, "", "environment variable TANDEM_TRAINER_LR=nan: not"),
        ([], {}, "lr = -1.0", "[trainer] lr = -1.0: must be more than 0"),
        ([], {}, 'seed = "3"', '[trainer] seed = "3": a string: write it without quotes'),
        ([], {}, "max_step = 3", "[trainer] unknown key 'max_step' (did you mean 'max_steps'?)"),
        ([], {"TANDEM_TRAINER_LRR": "1"}, "", "environment variable TANDEM_TRAINER_LRR: tandem"),
        # a range with a gap (`unless`): dual clip needs c > 1; 0 is off
        (["--eps-clip-c", "1"], {}, "", "--eps-clip-c 1: must be more than 1, or 0 (off)"),
        ([], {}, "eps_clip_c = 0.5", "[trainer] eps_clip_c = 0.5: must be more than 1, or 0 (off)"),
    ],
)
def test_a_refused_value_is_named_as_it_was_given(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: dict[str, str],
    table: str,
    said: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "bad.toml"
    path.write_text(f"[trainer]\n{table}\n")
    with pytest.raises(ConfigError) as refused:
        resolve(TrainerConfig, ["--config", str(path), *argv], "trainer")
    assert said in str(refused.value), str(refused.value)


@pytest.mark.parametrize("table", list(CONFIGS))
def test_a_resolved_config_written_as_toml_reads_back_the_same(table: str, tmp_path: Path) -> None:
    cls = CONFIGS[table]
    some = {"router": ["--engine-urls", "http://a:1", "http://b:2", "--no-rollout"]}
    some |= {"trainer": ["--lr", "3e-5", "--no-bf16", "--save", "ck"], "engine": ["--port", "0"]}
    config = load(cls, some.get(table, []), table)
    path = tmp_path / f"{table}.toml"
    path.write_text(to_toml(config, table))
    assert load(cls, ["--config", str(path)], table) == config


def test_every_setting_has_one_name_in_the_tree_and_help_from_its_docstring() -> None:
    for table, cls in CONFIGS.items():
        help_text = parser(cls, f"tandem {table}").format_help()
        for leaf in leaves(cls):
            assert f"--{leaf.replace('_', '-')}" in help_text, (table, leaf)
    assert "Peak learning rate (AdamW), 0 to 1." in parser(TrainerConfig, "t").format_help()


def test_a_top_k_of_0_is_refused_naming_the_flag_and_what_it_may_be() -> None:
    """SGLang answers 400 to each request with top_k 0: refused at the start."""
    with pytest.raises(ConfigError, match=r"--rollout-top-k 0: must be at least 1, or -1 \(all\)"):
        resolve(RouterConfig, ["--rollout-top-k", "0"], "router")
    assert (
        resolve(RouterConfig, ["--rollout-top-k", "20"], "router")[0].sampling.rollout_top_k == 20
    )


def test_a_service_exits_2_naming_the_flag_of_a_bad_value() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.engine", "--max-batch-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "tandem engine: error: --max-batch-size 0: must be at least 1" in done.stderr
