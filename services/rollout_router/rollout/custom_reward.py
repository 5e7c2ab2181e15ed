"""A `--custom-rm-path` reward function: where it is and whether it compiles and takes the
reward's parameters (`split_path`, `import_problem`, read without running it) and loading it (`load_function`). Used by the router's rewards (rewards.py)
and by the worker processes that call it (reward_workers.py); knows nothing of either.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any


def split_path(path: str) -> tuple[str, str]:
    """(module or file, function name) of a --custom-rm-path."""
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    return module, name


def import_problem(path: str) -> str:
    """Why `load_function` could not load PATH ("" when it may), read as it reads without
    running any of it: the file of `file.py:fn`, or the module of `pkg.mod:fn` in the current
    directory, on PYTHONPATH or installed (no package's `__init__` is run to find it); then that
    file's source compiled (a syntax error, by file and line) and a plain `def fn` of it checked
    to take (response_text, label, stopped). What only running it tells (its imports, a
    decorated or assigned `fn`) is the import's to find at the router's start."""
    module_name, name = split_path(path)
    if not module_name:
        return f"--custom-rm-path {path}: give the module and the function (module:fn, file.py:fn)"
    if module_name.endswith(".py"):
        if not Path(module_name).is_file():
            return f"--custom-rm-path {path}: no file {module_name}"
        return source_problem(path, Path(module_name), name)
    top = module_name.split(".")[0]
    try:
        if not (PathFinder.find_spec(top, [os.getcwd()]) or importlib.util.find_spec(top)):
            return (
                f"--custom-rm-path {path}: no module {top} in the current folder "
                f"({os.getcwd()}) or on PYTHONPATH: run tandem up from the folder that holds it "
                "(a resume too), put that folder on PYTHONPATH, or give the file "
                "(--custom-rm-path path/to/file.py:fn)"
            )
        file = module_file(module_name)
    except (ImportError, ValueError):  # a finder that fails: the import itself will say
        return ""
    return source_problem(path, file, name) if file else ""


def module_file(name: str) -> Path | None:
    """The source file of module NAME as the import finds it (the current directory first),
    found without running any package's `__init__`; None when it is no plain .py file."""
    spec, places = None, [os.getcwd(), *sys.path]
    for part in name.split("."):
        spec = PathFinder.find_spec(part, places)
        if spec is None:
            return None
        places = list(spec.submodule_search_locations or [])
    origin = spec.origin if spec else None
    return Path(origin) if origin and origin.endswith(".py") else None


def source_problem(path: str, file: Path, name: str) -> str:
    """A syntax error of `file` (by file and line), or its top-level undecorated `def NAME` not
    callable as NAME(response_text, label, stopped); "" when neither (compiled, never run)."""
    try:
        tree = ast.parse(file.read_bytes(), str(file))
        compile(tree, str(file), "exec")  # (what the parser lets by: `return` outside a def)
    except SyntaxError as exc:
        return (
            f"--custom-rm-path {path}: {exc.filename}:{exc.lineno}: syntax error: {exc.msg}; "
            "fix the file"
        )
    except OSError as exc:
        return f"--custom-rm-path {path}: cannot read {file} ({exc.strerror})"
    except ValueError:  # (null bytes): the import will say
        return ""
    fn = ([None] + [node for node in tree.body if binds(node, name)])[-1]  # (the last binding)
    if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.decorator_list:
        return ""  # (assigned, imported or decorated: what it takes is known by running it)
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    takes_three = len(positional) >= 3 or args.vararg is not None
    if takes_three and len(positional) - len(args.defaults) <= 3 and None not in args.kw_defaults:
        return ""
    return (
        f"--custom-rm-path {path}: {name}({ast.unparse(args)}) ({file}:{fn.lineno}) cannot be "
        f"called as {name}(response_text, label, stopped); give it those three parameters "
        "(docs/train-your-model.md)"
    )


def binds(node: ast.stmt, name: str) -> bool:
    """Whether a top-level statement binds `name` (a def, a class, an assignment, an import)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name == name
    return any(
        (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id == name)
        or (isinstance(n, ast.alias) and (n.asname or n.name) == name)
        for n in ast.walk(node)
    )


def load_function(path: str) -> Callable[..., Any]:
    """`package.module:function`, `package.module.function` or `path/to/file.py:function`;
    a module or file is looked up from the current directory first (as under `python -m`); a
    file imports modules beside it. The error names the path."""
    module_name, attr = split_path(path)
    try:
        if module_name.endswith(".py"):
            file = Path(module_name).resolve()
            spec = importlib.util.spec_from_file_location(file.stem, file)
            if spec is None or spec.loader is None or not file.is_file():
                raise ImportError(f"no Python file {file}")
            if str(file.parent) not in sys.path:  # its own imports, as when run as a script
                sys.path.append(str(file.parent))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, ValueError, SyntaxError) as exc:
        raise ValueError(f"--custom-rm-path {path!r}: cannot import it ({exc})") from exc
    if not callable(fn):
        raise ValueError(f"--custom-rm-path {path!r} is not callable")
    try:  # at start-up, not as a TypeError on every sample of the run
        signature = inspect.signature(fn)
        signature.bind("response_text", "label", True)
    except TypeError as exc:
        raise ValueError(
            f"--custom-rm-path {path!r}: {attr}{signature} cannot be called as "
            f"{attr}(response_text, label, stopped) ({exc}); give it those three parameters "
            "(docs/train-your-model.md)"
        ) from None
    except ValueError:  # no signature to read (some built-ins): called as it is
        pass
    return fn
