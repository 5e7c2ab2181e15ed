"""The engine's request and response shapes, checked against SGLang's own definitions.

SGLang cannot be imported without its GPU stack, so its source files (from
`pip install --no-deps sglang`) are parsed with `ast`: `io_struct.GenerateReqInput` (request
fields), `sampling_params.SamplingParams` (names and defaults), `schedule_batch.FINISH_*`
(finish_reason shapes), the `meta_info` keys `tokenizer_manager` writes, the route paths of
`http_server`, and the OpenAI protocol models. Skipped when sglang is not installed.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import httpx
import pytest

from services.engine import api, sampling

_spec = importlib.util.find_spec("sglang")
if _spec is None or not _spec.submodule_search_locations:
    pytest.skip(
        "sglang source not installed (pip install --no-deps sglang)", allow_module_level=True
    )
SRT = Path(next(iter(_spec.submodule_search_locations))) / "srt"


def parse(relative: str) -> ast.Module:
    return ast.parse((SRT / relative).read_text())


def class_fields(module: ast.Module, name: str) -> dict[str, ast.expr | None]:
    """Annotated fields of class `name` with their default expressions."""
    for node in ast.walk(module):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                stmt.target.id: stmt.value
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            }
    raise AssertionError(f"class {name} not found")


def meta_info_keys(module: ast.Module) -> set[str]:
    """Every key `tokenizer_manager` puts into a `meta_info` dict."""
    keys: set[str] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Name)
                    and target.id == "meta_info"
                    and isinstance(node.value, ast.Dict)
                ):
                    keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "meta_info"
                    and isinstance(target.slice, ast.Constant)
                ):
                    keys.add(target.slice.value)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "meta_info"
        ):
            for arg in node.args:
                if isinstance(arg, ast.Dict):
                    keys |= {k.value for k in arg.keys if isinstance(k, ast.Constant)}
    return keys


def finish_reason_keys(module: ast.Module) -> dict[str, set[str]]:
    """`type` -> keys of the dict each FINISH_* class's to_json returns."""
    shapes: dict[str, set[str]] = {}
    for node in ast.walk(module):
        if isinstance(node, ast.ClassDef) and node.name.startswith("FINISH"):
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Dict):
                    keys = {
                        k.value: v
                        for k, v in zip(ret.value.keys, ret.value.values, strict=True)
                        if isinstance(k, ast.Constant)
                    }
                    kind = keys["type"].value  # type: ignore[attr-defined]
                    shapes.setdefault(kind, set()).update(keys)
    return shapes


@pytest.fixture(scope="module")
def engine(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from conftest import ServiceProcess

    service = ServiceProcess(
        ["engine", "--model", str(toy_model_dir), "--port", "0"],
        tmp_path_factory.mktemp("e"),
        "engine",
    )
    yield service
    service.stop()


def test_every_generate_field_we_read_or_ignore_is_a_field_of_sglang_generate_req_input() -> None:
    sglang_fields = set(class_fields(parse("managers/io_struct.py"), "GenerateReqInput"))
    ours = api.IMPLEMENTED_FIELDS | api.UNSUPPORTED_FIELDS | api.IGNORED_FIELDS
    assert ours - sglang_fields == set()


def test_sampling_parameter_names_and_defaults_match_sglang() -> None:
    fields = class_fields(parse("sampling/sampling_params.py"), "SamplingParams")
    ours = sampling.SamplingParams()
    names = (
        {f for f in vars(ours)}
        | set(sampling.NEUTRAL_PARAMS)
        | sampling.IGNORED_PARAMS - {"lora_path"}
    )
    assert names - set(fields) == set()
    for name, value in vars(ours).items():
        default = fields[name]
        if isinstance(default, ast.Constant):
            assert default.value == value or (default.value is None and value in ([], None)), name
    for name, neutral in sampling.NEUTRAL_PARAMS.items():
        default = fields[name]
        if isinstance(default, ast.Constant):
            assert default.value == neutral, name


def test_finish_reasons_have_sglang_shapes(engine) -> None:  # type: ignore[no-untyped-def]
    shapes = finish_reason_keys(parse("managers/schedule_batch.py"))
    length = httpx.post(
        f"{engine.url}/generate",
        json={"input_ids": [1, 4], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}},
    ).json()
    stop = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": [1, 4],
            "sampling_params": {"max_new_tokens": 2, "stop_token_ids": list(range(16))},
        },
    ).json()
    from services.engine.scheduler import abort_reason

    for reason in (
        length["meta_info"]["finish_reason"],
        stop["meta_info"]["finish_reason"],
        abort_reason("x"),
    ):
        assert set(reason) == shapes[reason["type"]], reason


def test_meta_info_keys_are_keys_sglang_returns(engine) -> None:  # type: ignore[no-untyped-def]
    sglang_keys = meta_info_keys(parse("managers/tokenizer_manager.py"))
    out = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": [1, 4],
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 2},
        },
    ).json()
    assert set(out["meta_info"]) - sglang_keys == set()
    required = {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_version",
        "output_token_logprobs",
    }
    assert required <= set(out["meta_info"])


def test_our_routes_exist_in_sglang_http_server_except_the_zmq_extension(engine) -> None:  # type: ignore[no-untyped-def]
    source = (SRT / "entrypoints/http_server.py").read_text()
    spec = httpx.get(f"{engine.url}/openapi.json").json()
    ours = {path for path in spec["paths"] if not path.startswith(("/docs", "/openapi", "/redoc"))}
    extensions = {"/update_weights_from_zmq", "/get_weight_version", "/get_load"}
    # SGLang serves /metrics (--enable-metrics) as a Mount made in utils/common.py.
    common = (SRT / "utils/common.py").read_text()
    mounted = {"/metrics"} if 'Mount("/metrics"' in common else set()
    missing = {path for path in ours - extensions - mounted if f'"{path}"' not in source}
    assert missing == set()


def test_openai_fields_we_read_exist_in_sglang_protocol() -> None:
    from services.engine.openai_api import _SAMPLING_FIELDS

    protocol = parse("entrypoints/openai/protocol.py")
    completion = set(class_fields(protocol, "CompletionRequest"))
    chat = set(class_fields(protocol, "ChatCompletionRequest"))
    shared = set(_SAMPLING_FIELDS) | {"max_tokens", "stream", "rid", "return_token_ids"}
    assert shared - completion == set()
    chat_only = {"max_completion_tokens", "top_logprobs", "return_meta_info", "messages"}
    assert ((shared - {"json_schema"}) | chat_only) - chat == set()  # chat has response_format
    choice = set(class_fields(protocol, "ChatCompletionResponseChoice"))
    assert {
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "matched_stop",
        "prompt_token_ids",
        "response_token_ids",
        "meta_info",
    } - choice == set()
