"""Configuration: a TOML file under environment variables under flags, for `tandem up` and each
service; `tandem config show`; the run folder's config.toml repeats a run; first-class flags,
task defaults and the one-GPU layout; the generated reference is current. In-process parsing:
nothing starts (tests/test_router_datasets.py and test_router_agents.py check, through the
router process, that evaluation scores the running task's held-out data)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.common.settings import flat, load
from services.rollout_router.config import RouterConfig
from services.rollout_router.rollout.custom_reward import load_function
from services.rollout_router.rollout.tasks import (
    DATASET_RESPONSE_LEN,
    dataset_task,
    toy_reverse_digits,
)
from tandem import config_cmd, launcher, up_services
from tandem.up_args import RUN_CONFIG, save_config
from tandem.up_launch import UpConfig
from tandem.up_services import run_values

ROOT = Path(__file__).resolve().parents[1]


def toml_file(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_that_depend_on_the_model_are_the_toys_or_a_pretrained_ones(
    tmp_path: Path, capsys
) -> None:
    """The toy model's 1e-3 would wreck a pretrained --model in a few steps: 1e-6 there."""
    from tandem.up_run import UpRun

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "tokenizer.json").write_text("{}")  # (tandem up looks for one)

    def trainer_lr(*argv: str) -> float:
        tree, problems = launcher.parse(list(argv))
        assert problems == [] and tree is not None
        return tree.value("trainer", "lr")

    assert trainer_lr() == 1e-3
    assert trainer_lr("--model", str(model)) == 1e-6
    assert trainer_lr("--model", str(model), "--lr", "3e-6") == 3e-6
    tree = launcher.parse(["--model", str(model)])[0]
    run = SimpleNamespace(config=tree.up, tree=tree, eval_task="")
    run.model_defaults = lambda: UpRun.model_defaults(run)  # type: ignore[arg-type]
    UpRun.say_router_terms(run, {"eval_task": "t"})  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert (
        "[up] learning rate 1e-06, no wall-clock limit, no held-out accuracy goal (the run "
        "ends at --max-steps), 900 s for a service to start, 3600 s without progress (the "
        "defaults for a --model; --lr, --time-limit-s, --stop-accuracy, --startup-timeout-s, "
        "--stall-fail-s set them)"
    ) in out.splitlines()
    toy = launcher.parse([])[0]
    limits = ("time_limit_s", "startup_timeout_s", "stall_fail_s", "stop_accuracy")
    assert tuple(toy.up.by_model(n) for n in limits) == (900, 180, 600, 0.9)
    real = launcher.parse(["--model", str(model), "--time-limit-s", "60"])[0]
    assert tuple(real.up.by_model(n) for n in limits) == (60, 900, 3600, 0)
    save_config(tmp_path, real, str(model))  # a run folder saves them resolved
    saved = json.loads((tmp_path / "up_config.json").read_text())
    assert (saved["time_limit_s"], saved["startup_timeout_s"]) == (60.0, 900.0)
    assert saved["stop_accuracy"] == 0  # resumed: kept (0 is no goal, not "the model's")
    # a target given is kept either way, 0 (none) for the toy model too
    given = launcher.parse(["--model", str(model), "--stop-accuracy", "0.7"])[0]
    assert given.up.by_model("stop_accuracy") == 0.7
    assert launcher.parse(["--stop-accuracy", "0"])[0].up.by_model("stop_accuracy") == 0
    assert launcher.parse(["--stop-accuracy", "-0.5"])[1] == [
        "--stop-accuracy -0.5: must be at least 0, or -1 (model's default)"
    ]
    # the trainer's --max-steps 0 runs until stopped; tandem up's run ends at --max-steps
    assert launcher.parse(["--max-steps", "0"])[1] == [
        "--trainer.max-steps 0: must be more than 0 (tandem up's run ends there)"
    ]
    # a --model run that finished --max-steps with no target did what was asked: exit 0; the
    # toy model's run that ends there below its 0.9 exits 1
    trainer = SimpleNamespace(name="trainer", proc=SimpleNamespace(returncode=0))
    for tree, code, outcome in ((real, 0, "max_steps"), (toy, 1, "max_steps_without_accuracy")):
        steps = tree.value("trainer", "max_steps")
        ended = SimpleNamespace(config=tree.up, max_steps=steps, outcome="", run_dir=Path("RUN"))
        assert UpRun.child_exited(ended, trainer, steps) == code  # type: ignore[arg-type]
        assert ended.outcome == outcome
        # (before --max-steps: stopped by a signal of someone else's, either model)
        assert UpRun.child_exited(ended, trainer, steps - 1) == 1  # type: ignore[arg-type]
        assert ended.outcome == "trainer_stopped"

    # a --model trained on a GPU trains in bf16 (as the engines serve it), unless told not to
    def bf16(*argv: str) -> bool:
        tree, problems = launcher.parse([*argv, "--trainer-gpus", "0"])
        assert problems == [] and tree is not None
        return run_values(tree, "r", model, "redis://x", Path("run")).get("bf16", False)

    assert bf16("--model", str(model))
    assert not bf16()  # the toy model: fp32
    assert not bf16("--model", str(model), "--no-bf16")
    # a [trainer] table that says (a run recorded before this default, resumed) rules
    older = tmp_path / "older.toml"
    older.write_text("[trainer]\nbf16 = false\n")
    assert not bf16("--model", str(model), "--config", str(older))


def test_a_flag_beats_a_variable_which_beats_the_file(tmp_path: Path, monkeypatch, capsys) -> None:
    path = toml_file(
        tmp_path,
        "[up]\nseed = 3\n\n[trainer]\nmax_steps = 7\nlr = 0.5\n\n"
        '[router]\nrollout_max_response_len = 512\npolicy = "round_robin"\n',
    )
    monkeypatch.setenv("TANDEM_TRAINER_MAX_STEPS", "9")
    tree, problems = launcher.parse(["--config", str(path), "--lr", "0.25"])
    assert problems == [] and tree is not None
    assert (tree.up.run.seed, tree.value("trainer", "max_steps")) == (3, 9)
    assert tree.value("trainer", "lr") == 0.25
    monkeypatch.setenv("TANDEM_ROUTER_POLICY", "session_affinity")
    ns = flat(load(RouterConfig, ["--config", str(path), "--eval-interval", "2"], "router"))
    assert (ns["rollout_max_response_len"], ns["policy"], ns["eval_interval"]) == (
        512,
        "session_affinity",
        2,
    )
    # a variable of no setting: it was ignored without a word (a token is no setting)
    monkeypatch.setenv("TANDEM_ROUTER_TOKEN", "t")
    monkeypatch.setenv("TANDEM_TRAINER_MAX_STEP", "5")
    said = "environment variable TANDEM_TRAINER_MAX_STEP: tandem up has no setting 'max_step' "
    assert said + "(did you mean 'max_steps'?)" in launcher.parse([])[1][0]
    monkeypatch.delenv("TANDEM_TRAINER_MAX_STEP")
    assert load(RouterConfig, [], "router").workers.policy == "session_affinity"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[router]\nrollout_max_response_length = 3\n", "did you mean 'rollout_max_response_len'"),
        ("[routr]\nseed = 1\n", "unknown table [routr] (did you mean 'router'"),
        ("[router]\nrollout-top-p = 0.5\n", "did you mean 'rollout_top_p'"),
        ('[router]\neval_interval = "often"\n', 'eval_interval = "often": a string: write it'),
        # a number, boolean or list quoted by mistake (a variable's text is read as a flag's)
        ('[router]\neval_interval = "2"\n', 'eval_interval = "2": a string: write it without'),
        ('[router]\nrollout_top_p = "0.5"\n', 'rollout_top_p = "0.5": a string: write it'),
        ('[router]\ndynamic_sampling = "true"\n', 'dynamic_sampling = "true": a string: write'),
        ('[router]\nrollout_stop_token_ids = "1 2"\n', '= "1 2": Input should be a valid list'),
        ('[router]\npolicy = "random"\n', "Input should be 'least_outstanding', 'round_robin'"),
    ],
)
def test_a_bad_key_or_value_exits_2_naming_file_key_and_closest_key(
    tmp_path: Path, capsys, text: str, expected: str
) -> None:
    path = toml_file(tmp_path, text)
    with pytest.raises(SystemExit) as exc:
        load(RouterConfig, ["--config", str(path)], "router")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and expected in err, err
    # tandem up checks every service's table before it starts anything (the settings loader's
    # words: tests/test_settings.py), naming the file and the key.
    if "[routr]" not in text:
        _config, problems = launcher.parse(["--config", str(path)])
        key = text.splitlines()[1].split(" = ")[0]
        assert len(problems) == 1 and f"{path}: [router] " in problems[0], problems
        assert key in problems[0] and ("did you mean" not in expected or expected in problems[0])


def test_a_service_table_that_contradicts_up_is_refused(tmp_path: Path) -> None:
    path = toml_file(tmp_path, "[trainer]\nrollout_batch_size = 16\n")
    _config, problems = launcher.parse(["--config", str(path)])
    assert len(problems) == 1
    assert (
        "[trainer] rollout_batch_size = 16" in problems[0]
        and "[up] rollout_batch_size" in (problems[0])
    )


def test_config_show_prints_every_table_and_its_output_repeats_the_run(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    (tmp_path / "train.jsonl").write_text('{"prompt": "12>", "label": "21"}\n')
    (tmp_path / "my_rewards.py").write_text("def score(text, label, stopped):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)  # where the module is found
    path = toml_file(
        tmp_path,
        f'[router]\nprompt_data = "{tmp_path / "train.jsonl"}"\napply_chat_template = true\n\n'
        "[trainer]\nmax_steps = 5\n\n[engine]\nkv_cache_gb = 1.5\n",
    )
    argv = ["--config", str(path), "--custom-rm-path", "my_rewards:score", "--seed", "4"]
    assert config_cmd.main(["show", *argv]) == 0
    shown = capsys.readouterr().out
    tables = tomllib.loads(shown)
    assert set(tables) == {"up", "router", "trainer", "broker", "engine"}
    assert tables["trainer"]["max_steps"] == 5 and tables["up"]["seed"] == 4
    assert tables["router"]["apply_chat_template"] is True
    assert tables["router"]["custom_rm_path"] == "my_rewards:score"
    assert tables["engine"]["kv_cache_gb"] == 1.5
    # What tandem up gives a service itself is shown as a comment, not set twice.
    assert "rollout_batch_size" not in tables["router"]
    assert "# seed = 4  # set by tandem up from [up] seed" in shown
    # Given back (stand-ins shown as the values they stand for), it resolves to the same run.
    recorded = toml_file(tmp_path, shown, RUN_CONFIG)
    assert config_cmd.main(["show", "--config", str(recorded)]) == 0
    assert tomllib.loads(capsys.readouterr().out) == tables


def test_a_recorded_configuration_takes_a_flag_over_its_settings(tmp_path: Path, capsys) -> None:
    """A run's config.toml holds `[router] rollout_max_response_len = 0`: `--resume RUN
    --rollout-max-response-len 6` (or `--config` of it with that flag) was refused as a
    contradiction, `remove it there`, in a file the user never wrote."""
    assert config_cmd.main(["show"]) == 0
    recorded = toml_file(tmp_path, capsys.readouterr().out, RUN_CONFIG)
    assert tomllib.loads(recorded.read_text())["router"]["rollout_max_response_len"] == 0
    assert (
        config_cmd.main(["show", "--config", str(recorded), "--rollout-max-response-len", "6"]) == 0
    )
    assert tomllib.loads(capsys.readouterr().out)["router"]["rollout_max_response_len"] == 6


def test_one_gpu_for_engine_and_trainer_is_a_layout(capsys) -> None:
    tree, problems = launcher.parse(["--engine-gpus", "0", "--trainer-gpus", "0"])
    assert problems == [] and tree is not None
    assert (tree.up.num_engines, tree.value("engine", "device")) == (1, "cuda")
    assert up_services.shared_gpus(tree) == [0]
    assert launcher.main(["--engine-gpus", "0", "--num-engines", "2"]) == 2
    assert "give one per engine" in capsys.readouterr().err


@pytest.mark.parametrize("spelling", [["--bf16"], ["--trainer.bf16"]])
def test_a_service_setting_reaches_its_service_bare_or_named(spelling: list[str], capsys) -> None:
    assert config_cmd.main(["show", *spelling]) == 0
    assert tomllib.loads(capsys.readouterr().out)["trainer"]["bf16"] is True


def test_an_unknown_flag_is_refused_before_anything_starts() -> None:
    _tree, problems = launcher.parse(["--rollout-max-respons-len", "8"])
    assert problems == [
        "unrecognized argument --rollout-max-respons-len (did you mean "
        "'rollout_max_response_len'?) (--help lists them)"
    ]


def test_greedy_rollouts_with_a_group_relative_advantage_are_refused_naming_both() -> None:
    """Temperature 0 made each group's 8 samples one response: every GRPO advantage was 0, the
    loss and gradient 0 at each step, and the run went on learning nothing without a word."""
    _config, problems = launcher.parse(["--rollout-temperature", "0"])
    assert problems == [
        "router: --rollout-temperature 0 samples greedily: the 8 samples of a prompt are one "
        "response, and the trainer's --advantage-estimator grpo (reward minus the group's mean) "
        "gives each an advantage of 0: nothing would be learned; sample with a temperature > 0 "
        "(--rollout-temperature, or [router])"
    ]
    _config, problems = launcher.parse(["--rollout-top-k", "1"])
    assert len(problems) == 1 and problems[0].startswith("router: --rollout-top-k 1 samples")
    for fine in (
        ["--rollout-temperature", "0", "--advantage-estimator", "gae"],
        ["--rollout-temperature", "0.6"],
    ):
        assert launcher.parse(fine)[1] == [], fine


def test_an_accuracy_goal_the_router_never_measures_is_refused(tmp_path: Path) -> None:
    """The run said `stop at held-out accuracy >= 0.9` and ran to --max-steps, unmeasured."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "12", "label": "21"}\n')
    own = ["--prompt-data", str(data), "--rm-type", "exact_match"]
    for argv, said in [
        (["--eval-interval", "0"], "but the router's --eval-interval 0 never"),
        (
            [*own, "--stop-accuracy", "0.5", "--eval-heldout-fraction", "0"],
            "holds no",
        ),
    ]:
        problems = launcher.parse(argv)[1]
        assert len(problems) == 1 and said in problems[0], problems
        assert "--stop-accuracy 0 (no goal)" in problems[0]
    for fine in (
        ["--eval-interval", "0", "--stop-accuracy", "0"],
        [*own, "--stop-accuracy", "0.5"],  # (5% held out)
        [*own, "--eval-heldout-fraction", "0", "--stop-accuracy", "0"],
    ):
        assert launcher.parse(fine)[1] == [], fine


def test_a_reward_is_a_module_or_a_file_looked_up_from_the_current_directory_and_a_file_imports_its_neighbours(
    tmp_path: Path, monkeypatch
) -> None:
    (tmp_path / "rw").mkdir()
    (tmp_path / "rw" / "helper_beside.py").write_text("TWO = 2\n")
    (tmp_path / "rw" / "reward_file.py").write_text(
        "from helper_beside import TWO\n\ndef fn(text, label, stopped):\n    return TWO\n"
    )
    (tmp_path / "cwd_reward_mod.py").write_text("def fn(text, label, stopped):\n    return 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_function("rw/reward_file.py:fn")("", "", True) == 2
    assert load_function("cwd_reward_mod:fn")("", "", True) == 3
    with pytest.raises(ValueError, match=r"--custom-rm-path 'rw/missing\.py:fn': cannot import"):
        load_function("rw/missing.py:fn")
    _config, problems = launcher.parse(["--custom-rm-path", "rw/missing.py:fn"])
    assert problems == ["router: --custom-rm-path rw/missing.py:fn: no file rw/missing.py"]


def test_the_configuration_reference_is_generated_from_the_flags() -> None:
    current = (ROOT / "docs" / "configuration.md").read_text()
    assert current == config_cmd.reference(), (
        "docs/configuration.md is stale: tandem config reference > docs/configuration.md"
    )
    assert "`rollout_max_response_len`" in current and "TANDEM_ROUTER_" in current


def test_config_reference_with_an_argument_says_it_takes_none(capsys) -> None:
    """It was told `unknown subcommand 'reference'`."""
    assert config_cmd.main(["reference", "--bogus"]) == 2
    assert "tandem config reference takes no arguments: ['--bogus']" in capsys.readouterr().err


class DigitTokenizer:
    """Stands in for a Hugging Face tokenizer in the split's unit test: one id per character."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}


def test_a_dataset_without_eval_data_holds_a_fraction_out_of_training(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}>", "label": f"l{i}"} for i in range(40)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    args = (DigitTokenizer(), str(tmp_path / "train.jsonl"), "", "prompt", "label", False)
    task = dataset_task(*args, heldout_fraction=0.05, seed=1)
    held, trained = {it.label for it in task.heldout}, {it.label for it in task.train}
    assert len(held) == 2 and len(trained) == 38 and not held & trained
    assert "2 prompts held out of" in task.heldout_source
    assert task.response_len == DATASET_RESPONSE_LEN  # sized for real answers, not the toy's 4
    assert dataset_task(*args, heldout_fraction=0.05, seed=1).heldout == task.heldout
    assert dataset_task(*args, heldout_fraction=0.0).heldout == []
    assert toy_reverse_digits(DigitTokenizer(), 1234).response_len == 4
    assert task.notes == ()


def test_data_whose_rows_have_no_label_is_named_on_the_console(tmp_path: Path, capsys) -> None:
    """Labels under another key than --label-key: every reward that compares with the label
    would score 0, a run that trains on nothing without a word."""
    from tandem.up_run import UpRun

    rows = [{"prompt": f"{i}>", "answer": f"l{i}"} for i in range(40)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    args = (DigitTokenizer(), str(tmp_path / "train.jsonl"), "", "prompt", "label", False)
    task = dataset_task(*args, heldout_fraction=0.05, seed=1)
    assert task.notes == (
        f"no row of {tmp_path / 'train.jsonl'} has a 'label': every label is empty, so a "
        "reward that compares the response with its label scores 0 (--label-key, a flag of "
        "tandem up and of the router, names the label's field)",
    )
    tree = launcher.parse([])[0]
    run = SimpleNamespace(config=tree.up, tree=tree, eval_task="", model_defaults=lambda: "")
    UpRun.say_router_terms(run, {"eval_task": "t", "task_notes": list(task.notes)})  # type: ignore[arg-type]
    assert f"[up] {task.notes[0]}" in capsys.readouterr().out.splitlines()
    # some rows without one: left out (an empty label would be compared with the responses)
    rows = [{"prompt": f"{i}>", "label": None if i in (3, 7) else f"l{i}"} for i in range(40)]
    rows[12]["label"] = ""
    del rows[20]["label"]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tokenized: list[str] = []

    class Counting(DigitTokenizer):
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
            tokenized.append(text)
            return super().__call__(text, add_special_tokens)

    task = dataset_task(Counting(), *args[1:])
    assert len(task.train) == 36 and all(item.label for item in task.train)
    assert sorted(tokenized) == sorted(f"{i}>" for i in range(40) if i not in (3, 7, 12, 20))
    assert task.notes == (
        f"4 of 40 rows of {tmp_path / 'train.jsonl'} have no 'label' (the first: row 4): left "
        "out, a reward would compare their responses with an empty label (--label-key, a flag "
        "of tandem up and of the router, names the label's field)",
    )


def test_labels_that_are_json_lists_or_objects_are_said_to_score_0_with_a_built_in_reward(
    tmp_path: Path,
) -> None:
    """`"label": ["21"]` reached the rewards as the text '["21"]': exact_match and the other
    built-in rewards scored every response 0, without a word."""
    data = tmp_path / "train.jsonl"
    rows = [("12>", "21"), ("34>", ["43"]), ("56>", 65), ("78>", {"answer": "87"})]
    data.write_text("\n".join(json.dumps({"prompt": p, "label": a}) for p, a in rows))
    task = dataset_task(DigitTokenizer(), str(data), "", "prompt", "label", False)
    labels = [item.label for item in [*task.train, *task.heldout]]
    assert sorted(labels) == sorted(["21", '["43"]', "65", '{"answer": "87"}'])
    assert task.notes == (
        f"2 of 4 rows of {data} have a 'label' that is a JSON list or object (the first: row 2, "
        '["43"]): a reward gets it as that JSON text, which the built-in rewards (--rm-type) '
        "compare the response with and score 0; a --custom-rm-path function can json.loads it",
    )


@pytest.mark.parametrize(
    ("flags", "keys"),
    [
        ([], ("prompt", "label")),
        (["--input-key", "question", "--label-key", "answer"], ("question", "answer")),
    ],
)
def test_tandem_up_names_the_fields_of_a_dataset_row_for_the_router(
    flags: list[str], keys: tuple[str, str], tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text(json.dumps(dict.fromkeys(keys, "1")) + "\n")
    _tree, problems = launcher.parse(["--prompt-data", "train.jsonl", *flags])
    assert problems == [
        f"router: --prompt-data {tmp_path / 'train.jsonl'}: choose how its responses are scored: "
        "--rm-type exact_match|last_number|boxed, --custom-rm-path FILE.py:fn, or the router's "
        "--rm-url (the default, reverse_digits, is the toy task's verifier)"
    ]
    for reward in (["--rm-type", "boxed"], ["--rm-url=http://x/score"]):
        tree, problems = launcher.parse(["--prompt-data", "train.jsonl", *flags, *reward])
        assert problems == [] and tree is not None
    router = [tree.value("router", k) for k in ("prompt_data", "input_key", "label_key")]
    assert router == [str(tmp_path / "train.jsonl"), *keys]


def test_samples_longer_than_the_trainer_takes_are_refused_at_start(tmp_path: Path) -> None:
    """The router's longest prompt plus its response length against the trainer's micro-batch
    budget and response bound, from the run's recorded configuration: the longer samples would
    be dead-lettered, never trained (a bias toward short answers). Environment episodes, whose
    prompts grow, get a note when the model's context is larger than the trainer takes."""
    from tandem.supervisor import ChildFailedError
    from tandem.up_config import check_sample_fit

    said: list[str] = []
    info = {"longest_prompt": 4, "rollout_max_response_len": 4, "context_len": 64}

    def trainer(tokens: int, response: int) -> object:
        return launcher.parse(
            ["--max-tokens-per-gpu", str(tokens), "--max-response-len", str(response)]
        )[0]

    with pytest.raises(ChildFailedError) as refused:
        check_sample_fit(info, trainer(6, 32768), said.append)
    assert str(refused.value).startswith("the router's samples may reach 8 tokens (its longest")
    assert "(tandem up --max-tokens-per-gpu 7)" in str(refused.value)
    # (why 7 inputs, not 8: "at most 7 in all (--max-tokens-per-gpu 6)" read as a mistake)
    assert "at most 7 in all (--max-tokens-per-gpu 6: a sample's inputs, every token but" in str(
        refused.value
    )
    check_sample_fit(info, trainer(7, 32768), said.append)
    with pytest.raises(ChildFailedError, match=r"and 3 of response \(--max-response-len\)"):
        check_sample_fit(info, trainer(8192, 3), said.append)
    episodes = {"longest_prompt": None, "rollout_max_response_len": 4, "context_len": 40960}
    check_sample_fit(episodes, trainer(8192, 3), said.append)
    assert said == [
        "environment episodes are cut at 8193 tokens, what the trainer takes "
        "(--max-tokens-per-gpu 8192), short of the model's context, 40960: to train longer "
        "episodes, raise it (tandem up --max-tokens-per-gpu 40959)"
    ]


def test_a_hub_id_is_read_from_the_hugging_face_cache_or_refused_naming_its_download(
    tmp_path: Path, toy_model_dir: Path
) -> None:
    """`--model ORG/NAME` that is no folder here: the Hugging Face cache's copy (here, one laid
    out as `hf download` leaves it), given to every service; one it lacks is refused (exit 2)
    naming the command that downloads it. No network: HF_HUB_OFFLINE."""
    import os
    import shutil
    import subprocess

    repo = tmp_path / "hub" / "models--tandem-test--toy"
    shutil.copytree(toy_model_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}

    def show(model: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "tandem.cli", "config", "show", "--model", model]
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)

    shown = show("tandem-test/toy")
    assert shown.returncode == 0, shown.stderr
    snapshot = str((repo / "snapshots" / "abc123").resolve())
    tables = tomllib.loads(shown.stdout)
    assert tables["up"]["model"] == snapshot
    assert f"--model tandem-test/toy: the Hugging Face cache's copy, {snapshot}" in shown.stderr
    missing = show("tandem-test/absent")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "the Hugging Face cache holds no copy of it" in missing.stderr
    assert "download it first (hf download tandem-test/absent)" in missing.stderr
    assert "no such folder (a Hugging Face model's)" not in missing.stderr, "said once"
    (repo / "snapshots" / "abc123" / "model.safetensors").unlink()  # a partial download
    partial = show("tandem-test/toy")
    assert partial.returncode == 2 and "lacks config.json or its weights" in partial.stderr


def test_config_show_of_a_resume_prints_only_toml_on_stdout_its_notes_on_stderr(
    tmp_path: Path, capsys
) -> None:
    """`tandem config show --resume RUN > run.toml` of a run that stopped at its accuracy goal
    began with the resume's note, `[up] the run stopped at its accuracy goal ...`: no TOML."""
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text('{"model_type": "llama"}')
    (run / "model" / "tokenizer.json").write_text("{}")
    saved = {**flat(UpConfig()), "model": str(run / "model"), "run_dir": str(run)}
    (run / "up_config.json").write_text(json.dumps({**saved, "stop_accuracy": 0.9}))
    summary = {"outcome": "reached_accuracy", "accuracy_best": 0.95}
    (run / "summary.json").write_text(json.dumps(summary))
    assert config_cmd.main(["show", "--resume", str(run)]) == 0
    out, err = capsys.readouterr()
    assert tomllib.loads(out)["up"]["stop_accuracy"] == 0.9
    assert "the run stopped at its accuracy goal" in err
