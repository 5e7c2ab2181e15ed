"""A `--custom-rm-path` reward function: where it is (`split_path`, `import_problem`, looked up
without running it) and loading it (`load_function`). Used by the router's rewards (rewards.py)
and by the worker processes that call it (reward_workers.py); knows nothing of either.
"""

from __future__ import annotations

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
    """Why `load_function` could not import PATH ("" when it may), looked up as it looks
    without running any of it: the file of `file.py:fn`, or the top-level package or module of
    `pkg.mod:fn` in the current directory, on PYTHONPATH or installed (the rest of a dotted path
    is the import's to find)."""
    module_name, _ = split_path(path)
    if not module_name:
        return f"--custom-rm-path {path}: give the module and the function (module:fn, file.py:fn)"
    if module_name.endswith(".py"):
        found = Path(module_name).is_file()
        return "" if found else f"--custom-rm-path {path}: no file {module_name}"
    top = module_name.split(".")[0]
    try:
        if PathFinder.find_spec(top, [os.getcwd()]) or importlib.util.find_spec(top):
            return ""
    except (ImportError, ValueError):  # a finder that fails: the import itself will say
        return ""
    return (
        f"--custom-rm-path {path}: no module {top} in the current folder ({os.getcwd()}) or "
        "on PYTHONPATH: run tandem up from the folder that holds it (a resume too), put that "
        "folder on PYTHONPATH, or give the file (--custom-rm-path path/to/file.py:fn)"
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
