"""Where things are: the repository, bench/ and its results, and importing a repository file by
its path."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import ModuleType

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
QUICK_RESULTS_DIR = os.path.join(RESULTS_DIR, "quick")


def repo_path(relative: str) -> str:
    """An absolute path inside the repository (``"examples/digits.py:make_job"`` works too)."""
    return os.path.join(REPO_ROOT, relative)


def load_file(relative: str) -> ModuleType:
    """Import a file of the repository by its path (e.g. an example's analytic model), without
    touching ``sys.path``. Job factories are better passed to virtualflow as a
    ``"path.py:function"`` string: virtualflow imports those itself."""
    path = repo_path(relative)
    name = "_bench_file_" + re.sub(r"\W", "_", relative)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
