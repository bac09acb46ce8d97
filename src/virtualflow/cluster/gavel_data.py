"""Where Gavel's measured throughputs and example traces are: package data, nothing to configure.

The files (from https://github.com/stanford-futuredata/gavel, MIT licence) ship inside the
package under ``virtualflow/cluster/data/gavel/``; ``data/gavel/README.md`` says what each one is.
They are found with ``importlib.resources``, so a plain clone (``PYTHONPATH=src``), an editable
install and a wheel all find them without any set-up.

``$VIRTUALFLOW_GAVEL_DATA`` optionally points at another folder of the same layout
(``simulation_throughputs.json`` and ``traces/*.trace``), e.g. a newer copy of Gavel's data.

Invariants: ``gavel_data_dir()`` returns an existing folder or raises ``FileNotFoundError``
naming what is missing; ``gavel_trace_path`` only returns files of that folder's ``traces/``.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

__all__ = ["GAVEL_DATA_ENV", "gavel_data_dir", "gavel_trace_names", "gavel_trace_path"]

GAVEL_DATA_ENV = "VIRTUALFLOW_GAVEL_DATA"
THROUGHPUTS_FILE = "simulation_throughputs.json"


def _bundled_dir() -> Path:
    root = resources.files("virtualflow.cluster") / "data" / "gavel"
    # A package imported from a zip archive has no real folder; every supported install
    # (source tree, editable, wheel) unpacks to one.
    if not isinstance(root, Path):
        raise FileNotFoundError(f"Gavel data {root} is not on the file system (virtualflow imported from an "
                                f"archive?); install virtualflow unpacked or set ${GAVEL_DATA_ENV}")
    if not (root / THROUGHPUTS_FILE).is_file():
        raise FileNotFoundError(f"Gavel data missing from the installed package: {root / THROUGHPUTS_FILE} does "
                                "not exist; reinstall virtualflow (its package data ships the file)")
    return root


def gavel_data_dir() -> Path:
    """Folder holding Gavel's ``simulation_throughputs.json`` and ``traces/``: the copy bundled
    with the package, or ``$VIRTUALFLOW_GAVEL_DATA`` when that is set."""
    env = os.environ.get(GAVEL_DATA_ENV)
    if env:
        path = Path(env).expanduser().resolve()
        if not path.is_dir():
            raise FileNotFoundError(f"Gavel data folder {path} does not exist (${GAVEL_DATA_ENV}={env!r}); point it "
                                    f"at a folder holding {THROUGHPUTS_FILE} and traces/, or unset it to use "
                                    "the copy bundled with virtualflow")
        return path
    return _bundled_dir()


def gavel_trace_names() -> tuple[str, ...]:
    """File names of the traces in ``gavel_data_dir() / "traces"``, sorted."""
    return tuple(sorted(p.name for p in (gavel_data_dir() / "traces").glob("*.trace")))


def gavel_trace_path(name: str) -> Path:
    """Path of the trace called ``name`` (``"small_test"`` or ``"small_test.trace"``)."""
    file = name if name.endswith(".trace") else f"{name}.trace"
    names = gavel_trace_names()
    if file not in names:
        raise ValueError(f"{name!r} is not one of Gavel's traces bundled with virtualflow; they are {list(names)}")
    return gavel_data_dir() / "traces" / file
