"""The HTTP surface of the pinned SGLang, read from the installed `sglang` package's source.

Nothing of SGLang is imported as a package (`import sglang` pulls in its GPU serving stack):
- routes: the `@app.get/post/put/api_route(...)` decorators of `sglang/srt/entrypoints/
  http_server.py`, parsed with `ast`, each with the request class its handler's first argument
  is annotated with (`obj: Annotated[UpdateWeightFromDiskReqInput, Body()]`);
- request classes: the annotated fields (with their inherited ones) of the classes in
  `sglang/srt/managers/io_struct.py`, parsed with `ast`; `check_body` refuses a field the class
  does not have, a missing required field and a value of the wrong JSON type;
- `/generate`: also SGLang's own contract gate, `sglang/api/v1/api_types.py` (generated,
  msgspec only), loaded from its file: it refuses unknown `sampling_params` keys as SGLang does;
- chat messages: how SGLang reads a chat template's content format and turns a message's content
  into what the template gets (`sglang/srt/parser/jinja_template_utils.py`, loaded from its file
  with the three names it takes from `sglang.srt.utils` stood in: they concern images and
  video), and its `normalize_tool_content` (serving_chat.py, the function's source alone).

Moving the pin: change `sglang==0.5.23` in the Makefile (and the note in README.md), reinstall
with `pip install --no-deps sglang==X`, run `pytest tests/test_sglang_contract.py`: a route or a
field Tandem uses that the new version dropped fails there, naming it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the sglang package is not installed: `pip install --no-deps sglang==0.5.23` "
            "(the Makefile does it; it is read, never run)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class Field:
    name: str
    annotation: ast.expr | None
    required: bool


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    body_class: str | None


def _const_path(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    # os.environ.get("SGLANG_..._ROUTE", "/api/chat"): the default is the route
    if isinstance(node, ast.Call) and len(node.args) == 2:
        return _const_path(node.args[1])
    return None


def _body_class(fn: ast.FunctionDef | ast.AsyncFunctionDef, classes: set[str]) -> str | None:
    for arg in fn.args.args[:1]:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple):  # Annotated[X, …]
            ann = ann.slice.elts[0]
        if isinstance(ann, ast.Name) and ann.id in classes:
            return ann.id
    return None


@functools.cache
def routes() -> dict[tuple[str, str], Route]:
    """(METHOD, path) -> Route, for every route the pinned SGLang's HTTP server declares."""
    tree = ast.parse((sglang_root() / "srt/entrypoints/http_server.py").read_text())
    classes = set(request_classes())
    table: dict[tuple[str, str], Route] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for deco in fn.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
                continue
            verb = deco.func.attr
            if verb not in {"get", "post", "put", "delete", "head", "api_route"} or not deco.args:
                continue
            path = _const_path(deco.args[0])
            if path is None:
                continue
            methods = [verb.upper()]
            for kw in deco.keywords:
                if kw.arg == "methods" and isinstance(kw.value, ast.List):
                    methods = [e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
            for method in methods:
                table[(method, path)] = Route(method, path, _body_class(fn, classes))
    return table


@functools.cache
def request_classes() -> dict[str, dict[str, Field]]:
    """Class name -> its fields (inherited ones included), for every class of io_struct.py."""
    tree = ast.parse((sglang_root() / "srt/managers/io_struct.py").read_text())
    own: dict[str, tuple[list[str], list[Field]]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = [
            Field(
                item.target.id,
                item.annotation,
                item.value is None and not _optional(item.annotation),
            )
            for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
        ]
        own[node.name] = ([b.id for b in node.bases if isinstance(b, ast.Name)], fields)

    def resolve(name: str) -> dict[str, Field]:
        bases, fields = own[name]
        merged: dict[str, Field] = {}
        for base in bases:
            if base in own:
                merged.update(resolve(base))
        merged.update({f.name: f for f in fields})
        return merged

    return {name: resolve(name) for name in own}


def _optional(ann: ast.expr | None) -> bool:
    return isinstance(ann, ast.Subscript) and _name(ann.value) == "Optional"


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def type_problem(value: Any, ann: ast.expr | None) -> str | None:
    """Why `value` (parsed JSON) does not fit annotation `ann`, or None. Unknown type names
    (io_struct's own aliases and classes) accept anything."""
    if ann is None:
        return None
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # a string annotation
        return type_problem(value, ast.parse(ann.value, mode="eval").body)
    name = _name(ann.value if isinstance(ann, ast.Subscript) else ann)
    args: list[ast.expr] = []
    if isinstance(ann, ast.Subscript):
        args = list(ann.slice.elts) if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    simple = {
        "str": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "dict": lambda v: isinstance(v, dict),
        "Dict": lambda v: isinstance(v, dict),
    }
    if name in simple:
        return None if simple[name](value) else f"expected {name}, got {value!r:.60}"
    if name == "Optional":
        return None if value is None else type_problem(value, args[0])
    if name == "Union":
        problems = [type_problem(value, a) for a in args]
        return None if None in problems else " or ".join(p for p in problems if p)
    if name in {"List", "list"}:
        if not isinstance(value, list):
            return f"expected a list, got {value!r:.60}"
        for item in value:
            if (problem := type_problem(item, args[0] if args else None)) is not None:
                return f"list item: {problem}"
        return None
    if name == "Literal":
        allowed = [a.value for a in args if isinstance(a, ast.Constant)]
        return None if value in allowed else f"expected one of {allowed}, got {value!r:.60}"
    return None


def check_body(class_name: str, body: Any) -> str | None:
    """What is wrong with a JSON body for request class `class_name`, or None."""
    if not isinstance(body, dict):
        return f"{class_name}: the body must be a JSON object"
    fields = request_classes()[class_name]
    for key, value in body.items():
        if key not in fields:
            return f"{class_name} has no field {key!r} (SGLang {version()})"
        if (problem := type_problem(value, fields[key].annotation)) is not None:
            return f"{class_name}.{key}: {problem}"
    for name, f in fields.items():
        if f.required and name not in body:
            return f"{class_name}.{name} is required"
    return None


@functools.cache
def api_types() -> ModuleType:
    """SGLang's generated `/generate` contract (`sglang/api/v1/api_types.py`, msgspec only)."""
    path = sglang_root() / "api/v1/api_types.py"
    spec = importlib.util.spec_from_file_location("_sglang_api_types", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate_problem(body: Any) -> str | None:
    """SGLang's 400 for a `/generate` body (its contract gate, then GenerateReqInput's fields)."""
    types = api_types()
    try:
        types.GenerateRequest.from_json_value(body)
    except types.JsonContractError as exc:
        return f"/generate: {exc}"
    return check_body("GenerateReqInput", body)


@functools.cache
def template_utils() -> ModuleType:
    """SGLang's `jinja_template_utils` module (content format, message content processing)."""
    import sys

    utils = ModuleType("sglang.srt.utils")  # (the real one imports SGLang's serving stack)
    utils.GLM_MEDIA_CONFIG_KEYS = ()  # type: ignore[attr-defined]
    utils.ImageData = utils.VideoData = dict  # type: ignore[attr-defined]
    saved = sys.modules.get("sglang.srt.utils")
    sys.modules["sglang.srt.utils"] = utils
    try:
        path = sglang_root() / "srt/parser/jinja_template_utils.py"
        spec = importlib.util.spec_from_file_location("_sglang_jinja_template_utils", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["sglang.srt.utils"]
        else:
            sys.modules["sglang.srt.utils"] = saved
    return module


@functools.cache
def normalize_tool_content() -> Any:
    """SGLang's `normalize_tool_content(role, content)` (serving_chat.py, its source alone)."""
    path = sglang_root() / "srt/entrypoints/openai/serving_chat.py"
    tree = ast.parse(path.read_text())
    (fn,) = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "normalize_tool_content"
    ]
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)
    return namespace["normalize_tool_content"]


def template_messages(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """What SGLang's jinja path hands `template` for `messages` given as its message classes
    dump them (every field present, null when not given): serving_chat's loop over them."""
    utils = template_utils()
    form = utils.detect_jinja_template_content_format(template)
    out = []
    for message in messages:
        message = {**message, "content": "" if message["content"] is None else message["content"]}
        done = utils.process_content_for_template_format(message, form, [], [], [], [])
        done["content"] = normalize_tool_content()(done["role"], done.get("content"))
        out.append(done)
    return out


@functools.cache
def version() -> str:
    import importlib.metadata

    return importlib.metadata.version("sglang")
