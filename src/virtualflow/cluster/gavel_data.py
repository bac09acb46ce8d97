"""Where Gavel's measured throughputs and example traces are: package data, nothing to configure.

The files (from https://github.com/stanford-futuredata/gavel, MIT licence) ship inside the
package under ``virtualflow/cluster/data/gavel/``; ``data/gavel/README.md`` says what each one is.
They are found with ``importlib.resources``, so a plain clone (``PYTHONPATH=src``), an editable
install and a wheel all find them without any set-up.

A caller may give another folder of the same layout (``simulation_throughputs.json`` and
``traces/*.trace``), e.g. a newer copy of Gavel's data: every function takes it as ``folder``. The
command line reads it from ``$VIRTUALFLOW_GAVEL_DATA`` (:data:`GAVEL_DATA_ENV`,
:func:`virtualflow.cli.simulate.gavel_data_from_env`); this module reads no environment.

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


def gavel_data_dir(folder: str | os.PathLike[str] | None = None, *, knob: str = "folder") -> Path:
    """Folder holding Gavel's ``simulation_throughputs.json`` and ``traces/``: the copy bundled
    with the package, or ``folder`` when one is given (empty or None: the bundled copy). ``knob``
    names where ``folder`` came from in the error when it does not exist."""
    if folder:
        path = Path(folder).expanduser().resolve()
        if not path.is_dir():
            raise FileNotFoundError(f"Gavel data folder {path} does not exist ({knob}={os.fspath(folder)!r}); point "
                                    f"it at a folder holding {THROUGHPUTS_FILE} and traces/, or unset it to use "
                                    "the copy bundled with virtualflow")
        return path
    return _bundled_dir()


def gavel_trace_names(folder: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """File names of the traces in ``gavel_data_dir(folder) / "traces"``, sorted."""
    return tuple(sorted(p.name for p in (gavel_data_dir(folder) / "traces").glob("*.trace")))


def gavel_trace_path(name: str, folder: str | os.PathLike[str] | None = None) -> Path:
    """Path of the trace called ``name`` (``"small_test"`` or ``"small_test.trace"``)."""
    file = name if name.endswith(".trace") else f"{name}.trace"
    names = gavel_trace_names(folder)
    if file not in names:
        raise ValueError(f"{name!r} is not one of Gavel's traces bundled with virtualflow; they are {list(names)}")
    return gavel_data_dir(folder) / "traces" / file
