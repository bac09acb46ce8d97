"""The import structure of ``src/virtualflow`` is a test, not a hope (docs/architecture.md).

Every ``import`` of every module is read with :mod:`ast` (nothing is imported, so the check is
pure and fast), and the test fails with one readable line per violation on:

* **circles**: modules that import each other, directly or through others (a strongly connected
  component of the import graph, printed as one concrete path ``a -> b -> a``);
* **upward imports**: a module importing a module of a higher layer (``LAYERS`` below; a layer
  imports only the layers below it, and modules of one layer import each other freely, as long
  as they form no circle);
* **ownership of the environment and processes**: ``os.environ``/``os.getenv``/``os.putenv``,
  ``subprocess``, ``multiprocessing`` (and ``torch.multiprocessing``, ``ProcessPoolExecutor``,
  ``os.fork``/``os.system``/``os.popen``/``os.spawn*``/``os.posix_spawn*``/``os.exec*``) and
  signal handlers (``signal.signal``, ``loop.add_signal_handler``) outside ``OWNERS``;
* **private names across modules**: ``from virtualflow.x import _name`` (a leading underscore,
  not a dunder) -- make the name public or move the code;
* **deprecated shims in use**: a module whose docstring starts ``Deprecated:`` (``Deprecated:
  moved to :mod:`virtualflow.NEW```, or ``Deprecated: split into :mod:`A`, :mod:`B` ...``) is an
  alias kept for users' old import paths; no module of ``src/`` may import it;
* **unplaced modules**: a module in a folder missing from ``LAYERS``, or a root module other than
  ``ROOT_MODULES`` that is not a shim.

How imports are read (the decisions, in one place):

* All imports count, wherever they are: at the top, inside functions (a lazy import is still a
  dependency: it runs at the first call and climbs the same way), and under
  ``if TYPE_CHECKING:`` (a type-only import still couples the two modules' concepts, and is how a
  circle hides until someone needs the name at run time). Messages mark the latter "type-only".
* ``from virtualflow.a import b`` is an edge to the module ``virtualflow.a.b`` when that module
  exists, else to ``virtualflow.a`` (a name defined in, or re-exported by, the package's
  ``__init__``). ``from virtualflow import Job`` in a lower layer is therefore an upward import
  of the public surface (layer 13).
* Importing ``virtualflow.a.b`` also runs ``virtualflow/a/__init__.py`` and
  ``virtualflow/__init__.py``; those implicit parent imports are not edges (else every module
  would import the top of the package). So a package ``__init__`` importing its own submodules is
  not a circle; a submodule importing back from its package's ``__init__`` (which imports it) is.
* A shim sits at layer 13 wherever its file lies (it re-exports a module's new home, which is
  below 13), and may re-export private names its old users imported; nothing imports it.

Run ``python tests/unit/test_layers.py`` (or ``python scripts/check_layers.py``) to print every
violation at once, grouped by kind; ``pytest tests/unit/test_layers.py`` fails per kind.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "virtualflow"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# ---- the layers (bottom -> top; the same table as docs/architecture.md) ---------------------
# folder -> (layer, what it owns). A module's layer is its first folder under virtualflow/.
LAYERS: dict[str, tuple[int, str]] = {
    "plan": (1, "pure planning: data order, VN maps, the hetero solver, pipeline schedules, plan/comm"),
    "records": (2, "run-directory records (rundir, atomic_write) and the Result a run returns"),
    "cluster": (3, "pure multi-job scheduling: policies, round mechanism, simulator, traces"),
    "parallel": (4, "public: tensor-parallel blocks and tracing a model into pipeline pieces"),
    "config": (5, "what users write: Job, Pipeline, LaunchOptions, spec, the fault plan's data"),
    "gnn": (6, "the Dorylus engine (pure parts and an engine that is given its executor)"),
    "comm": (7, "process groups, the store protocol, reductions, the ring, authentication"),
    "runtime": (8, "the worker: Engine protocol, VN and pipeline engines, checkpoints, transfer"),
    "observe": (9, "experiment trackers (MLflow, W&B callbacks) and TensorBoard events"),
    "control": (10, "coordinator, membership controller and its policies, autoscaling"),
    "backends": (11, "where workers run (local | ray | external), worker entry points, executors"),
    "launching": (12, "the launching process: prepare, preflight, resume, supervisor"),
    "(root)": (13, "the public surface: virtualflow/__init__.py, api.py, handle.py, shims"),
    "service": (14, "the cluster service (its process layer: __main__.py, launcher.py)"),
    "cli": (15, "one module per `virtualflow` verb (top)"),
}
ROOT_LAYER = LAYERS["(root)"][0]
# The root modules that belong at the root (all others move into a folder, leaving a shim).
ROOT_MODULES: dict[str, str] = {
    "virtualflow": "__init__.py: the declared public surface",
    "virtualflow.api": "train/launch: thin wiring of config, launch and backends",
    "virtualflow.handle": "JobHandle: the user's view of a launched job",
}
# Package ``__init__`` modules that are public facades: they sit at the root layer (13) whatever
# their folder, so they may gather names from the layers below (their own package's modules
# included); no module of ``src/`` may import them (they are for users).
FACADES: dict[str, str] = {
    "virtualflow.gnn": "the Dorylus API users import: the engine (gnn/) and its process executors (backends/gnn.py)",
}
SHIM_DOCSTRING = "Deprecated:"  # "Deprecated: moved to :mod:`X`" or "Deprecated: split into ..."

# ---- who may own the environment and processes -----------------------------------------------
# path under virtualflow/ (a folder ends with "/") -> why it may read the environment, start
# processes and install signal handlers. Everything else receives such values as arguments.
OWNERS: dict[str, str] = {
    "backends/": "starts and stops worker processes (local, Ray, external) and their entry points",
    "cli/": "the command line: reads the environment, starts the service, configures the process",
    "service/__main__.py": "the service daemon's entry point (its signals, its environment)",
    "service/launcher.py": "the service's process layer: starts the launcher of each job",
}
# (path under virtualflow/, what) -> why one use outside OWNERS is accepted. ``what`` is as
# printed in a violation, e.g. ("runtime/x.py", "os.environ"). Keep this empty if you can.
OWNERSHIP_EXCEPTIONS: dict[tuple[str, str], str] = {}

ENV_ATTRS = {"environ", "getenv", "putenv", "unsetenv", "environb", "getenvb"}
PROCESS_ATTRS = {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp",
                 "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
                 "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe"}
PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing")


# ---- reading the source -----------------------------------------------------------------------
@dataclass(frozen=True)
class Edge:
    target: str  # the module imported (resolved: a submodule, or the package/module named)
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`
    names: tuple[str, ...]  # the names taken from the target (`from x import a, b`); () for `import x`


@dataclass
class Module:
    name: str  # virtualflow.runtime.engine
    path: Path
    rel: str  # runtime/engine.py (under virtualflow/)
    shim: bool
    edges: list[Edge] = field(default_factory=list)
    uses: list[tuple[int, str]] = field(default_factory=list)  # (line, "os.environ") ownership uses


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` / `if typing.TYPE_CHECKING:` bodies."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
                    isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
                for stmt in node.body:
                    inside.update(id(n) for n in ast.walk(stmt))
    return inside


def _resolve(mod: Module, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(target module, names) for each virtualflow module ``node`` imports."""
    out: list[tuple[str, tuple[str, ...]]] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            out.append((alias.name, ()))
    else:
        if node.level:
            base = mod.name.split(".")
            if mod.path.name != "__init__.py":
                base = base[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        by_target: dict[str, list[str]] = defaultdict(list)
        for alias in node.names:
            sub = f"{prefix}.{alias.name}"
            if sub in known:
                by_target[sub].append(alias.name)  # `from pkg import submodule`
            else:
                by_target[prefix].append(alias.name)
        out.extend((t, tuple(n)) for t, n in by_target.items())
    resolved = []
    for target, names in out:
        if target != "virtualflow" and not target.startswith("virtualflow."):
            continue
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]  # `import virtualflow.a.b.name` -> the module
        resolved.append((target, names))
    return resolved


def _ownership_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each use of the environment, process start-up or signal handlers."""
    uses: list[tuple[int, str]] = []
    aliases = {"os": "os", "signal": "signal"}  # local name -> module (`import os as _os` too)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("os", "signal") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if any(alias.name == m or alias.name.startswith(m + ".") for m in PROCESS_MODULES):
                    uses.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            if any(node.module == m or node.module.startswith(m + ".") for m in PROCESS_MODULES):
                uses.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
            elif node.module == "torch" and "multiprocessing" in names:
                uses.append((node.lineno, "from torch import multiprocessing"))
            elif node.module == "os":
                for n in names:
                    if n in ENV_ATTRS or n in PROCESS_ATTRS:
                        uses.append((node.lineno, f"from os import {n}"))
            elif node.module == "signal" and "signal" in names:
                uses.append((node.lineno, "from signal import signal"))
            elif node.module == "concurrent.futures" and "ProcessPoolExecutor" in names:
                uses.append((node.lineno, "ProcessPoolExecutor"))
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name):
                module = aliases.get(node.value.id)
                if module == "os" and node.attr in ENV_ATTRS:
                    uses.append((node.lineno, f"os.{node.attr}"))
                elif module == "os" and node.attr in PROCESS_ATTRS:
                    uses.append((node.lineno, f"os.{node.attr}"))
                elif module == "signal" and node.attr == "signal":
                    uses.append((node.lineno, "signal.signal"))
            if node.attr == "add_signal_handler":
                uses.append((node.lineno, "add_signal_handler"))
            elif node.attr == "ProcessPoolExecutor":
                uses.append((node.lineno, "ProcessPoolExecutor"))
    return sorted(set(uses))


def read_modules(src: Path = SRC) -> dict[str, Module]:
    """Every module under ``src`` (a ``virtualflow`` package folder) with its edges and uses."""
    src = src.resolve()
    files = sorted(p for p in src.rglob("*.py") if "__pycache__" not in p.parts)
    mods = {module_name(p, src): p for p in files}
    known = set(mods)
    out: dict[str, Module] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        doc = ast.get_docstring(tree) or ""
        m = Module(name, path, path.relative_to(src).as_posix(), shim=doc.startswith(SHIM_DOCSTRING))
        typed = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, names in _resolve(m, node, known):
                    if target != name:
                        m.edges.append(Edge(target, node.lineno, id(node) in typed, names))
        m.uses = _ownership_uses(tree)
        out[name] = m
    return out


# ---- the rules --------------------------------------------------------------------------------
def layer_of(mod: Module) -> tuple[str, int] | None:
    """(layer name, layer number), or None for a module in no layer (an unplaced module)."""
    if mod.shim:
        return "shim", ROOT_LAYER
    if mod.name in FACADES:
        return "facade", ROOT_LAYER
    parts = mod.name.split(".")
    if len(parts) == 1 or (len(parts) == 2 and mod.path.name != "__init__.py"):  # virtualflow/x.py
        return ("(root)", ROOT_LAYER) if mod.name in ROOT_MODULES else None
    folder = parts[1]
    return (f"{folder}/", LAYERS[folder][0]) if folder in LAYERS else None


def _where(mod: Module, line: int) -> str:
    return f"virtualflow/{mod.rel}:{line}"


def _describe(mod: Module) -> str:
    lay = layer_of(mod)
    if lay is None:
        return f"{mod.name} (unplaced; taken as layer {ROOT_LAYER})"
    return f"{mod.name} ({lay[0]}, layer {lay[1]})"


def _layer_number(mod: Module) -> int:
    """An unplaced module is taken as the root layer: its importers below 13 are flagged too."""
    lay = layer_of(mod)
    return ROOT_LAYER if lay is None else lay[1]


def unplaced(mods: dict[str, Module]) -> list[str]:
    out = []
    for mod in mods.values():
        if layer_of(mod) is None:
            parts = mod.name.split(".")
            if len(parts) == 2 and mod.path.name != "__init__.py":
                out.append(f"virtualflow/{mod.rel}: a root module that is neither {', '.join(sorted(ROOT_MODULES))} "
                           f"nor a shim (docstring '{SHIM_DOCSTRING} ...'): move it into the folder of its layer")
            else:
                out.append(f"virtualflow/{mod.rel}: folder {parts[1]}/ is in no layer: add it to LAYERS "
                           f"(tests/unit/test_layers.py) and docs/architecture.md, or move the module")
    return sorted(out)


def upward_imports(mods: dict[str, Module]) -> list[str]:
    out = []
    for mod in mods.values():
        if mod.shim:
            continue  # a shim re-exports its new home; rule (shims) keeps it a leaf
        mine = _layer_number(mod)
        for e in mod.edges:
            dst = mods[e.target]
            if _layer_number(dst) > mine:
                kind = " (type-only)" if e.type_only else ""
                out.append(f"{_where(mod, e.line)}: {_describe(mod)} imports {_describe(dst)}{kind}: "
                           f"a layer imports only the layers below it")
    return sorted(out)


def _sccs(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return sorted(comps)


def _cycle_through(start: str, comp: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside ``comp`` (breadth first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt_frontier = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w not in comp:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + list(reversed(path[:-1])) + [start]
                if w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt_frontier.append(w)
        frontier = nxt_frontier
    return [start, start]


def circles(mods: dict[str, Module]) -> list[str]:
    edges: dict[str, set[str]] = defaultdict(set)
    lines: dict[tuple[str, str], Edge] = {}
    for mod in mods.values():
        for e in mod.edges:
            edges[mod.name].add(e.target)
            lines.setdefault((mod.name, e.target), e)
    out = []
    for comp in _sccs(sorted(mods), edges):
        path = _cycle_through(comp[0], set(comp), edges)
        steps = []
        for a, b in zip(path, path[1:]):
            e = lines[(a, b)]
            steps.append(f"{a} (line {e.line}{', type-only' if e.type_only else ''})")
        out.append(f"circle of {len(comp)} modules [{', '.join(comp)}]; one path: "
                   f"{' -> '.join(steps)} -> {path[-1]}")
    return out


def _owner(rel: str) -> bool:
    return any(rel.startswith(o) if o.endswith("/") else rel == o for o in OWNERS)


def ownership(mods: dict[str, Module]) -> list[str]:
    out = []
    for mod in mods.values():
        if _owner(mod.rel):
            continue
        for line, what in mod.uses:
            if (mod.rel, what) in OWNERSHIP_EXCEPTIONS:
                continue
            out.append(f"{_where(mod, line)}: {what} outside the owners of the environment and processes "
                       f"({', '.join(OWNERS)}): receive the value as an argument, or move the code to an owner")
    return sorted(out)


def private_imports(mods: dict[str, Module]) -> list[str]:
    out = []
    for mod in mods.values():
        if mod.shim:
            continue  # may re-export a private name its old users imported
        for e in mod.edges:
            private = [n for n in e.names if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
            last = e.target.rsplit(".", 1)[-1]
            if not e.names and last.startswith("_") and not last.startswith("__"):
                private.append(e.target)
            if private:
                out.append(f"{_where(mod, e.line)}: {mod.name} imports the private name(s) {', '.join(private)} "
                           f"from {e.target}: make it public (rename it) or move the code that needs it")
    return sorted(out)


def shim_imports(mods: dict[str, Module]) -> list[str]:
    out = []
    for mod in mods.values():
        for e in mod.edges:
            dst = mods[e.target]
            if dst.shim and dst.name != mod.name:
                doc = ast.get_docstring(ast.parse(dst.path.read_text(encoding="utf-8"))) or ""
                homes = re.findall(r":mod:`([\w.]+)`", doc)
                home = " or ".join(dict.fromkeys(homes)) if homes else "its new home"
                out.append(f"{_where(mod, e.line)}: {mod.name} imports the deprecated shim {e.target}: "
                           f"import {home} instead")
    return sorted(out)


RULES = {
    "circles": circles,
    "upward imports": upward_imports,
    "environment and processes outside their owners": ownership,
    "private names imported from another module": private_imports,
    "deprecated shims imported inside src": shim_imports,
    "modules in no layer": unplaced,
}


def all_violations(src: Path = SRC) -> dict[str, list[str]]:
    mods = read_modules(src)
    return {kind: rule(mods) for kind, rule in RULES.items()}


def report(violations: dict[str, list[str]]) -> str:
    lines = []
    for kind, found in violations.items():
        lines.append(f"== {kind}: {len(found)}")
        lines.extend(f"  {v}" for v in found)
    return "\n".join(lines)


# ---- the tests on src/virtualflow -------------------------------------------------------------
@pytest.fixture(scope="module")
def mods() -> dict[str, Module]:
    return read_modules(SRC)


def _fail_on(found: list[str], what: str) -> None:
    if found:
        pytest.fail(f"{len(found)} {what} (docs/architecture.md says why; python scripts/check_layers.py "
                    f"lists every kind at once):\n" + "\n".join(found), pytrace=False)


def test_no_import_circles(mods):
    _fail_on(circles(mods), "import circle(s)")


def test_no_upward_imports(mods):
    _fail_on(upward_imports(mods), "upward import(s)")


def test_environment_and_processes_only_in_their_owners(mods):
    _fail_on(ownership(mods), "use(s) of the environment, processes or signal handlers outside their owners")


def test_no_private_name_is_imported_from_another_module(mods):
    _fail_on(private_imports(mods), "import(s) of a private name from another module")


def test_no_src_module_imports_a_deprecated_shim(mods):
    _fail_on(shim_imports(mods), "import(s) of a deprecated shim inside src/")


def test_every_module_is_in_a_layer(mods):
    _fail_on(unplaced(mods), "module(s) in no layer")


def test_docs_architecture_lists_the_same_layers():
    """docs/architecture.md's layer table names the folders of LAYERS, with the same numbers."""
    rows = []
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|\s*`?([\w()]+)/?`?\s*\|", line)
        if m:
            rows.append((int(m.group(1)), m.group(2)))
    assert rows == [(n, folder) for folder, (n, _) in LAYERS.items()], (
        f"docs/architecture.md's layer table {rows} differs from LAYERS in tests/unit/test_layers.py")


# ---- the checker itself, on made-up packages (passes whatever the state of src/) -----------------
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "virtualflow"
    for rel, text in {"__init__.py": '"""top"""\n', **files}.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in {p.parent for p in src.rglob("*.py")}:
        if d != src and not (d / "__init__.py").exists():
            (d / "__init__.py").write_text('"""pkg"""\n')
    return src


def test_a_clean_package_has_no_violations(tmp_path):
    src = _package(tmp_path, {
        "plan/data.py": '"""pure"""\nimport os.path\n',
        "runtime/engine.py": '"""engine"""\nfrom virtualflow.plan.data import x\nfrom . import worker\n',
        "runtime/worker.py": '"""worker"""\nfrom virtualflow.plan import data\n',
        "runtime/__init__.py": '"""pkg"""\nfrom virtualflow.runtime.engine import Engine\n',  # own submodule
        "backends/local.py": '"""owner"""\nimport os, subprocess\nos.environ.get("X")\n',
        "api.py": '"""api"""\nfrom virtualflow.runtime import engine\n',
        "job.py": '"""Deprecated: moved to :mod:`virtualflow.config.job`; alias."""\n'
                  'from virtualflow.config.job import _private_for_old_tests\n',
        "config/job.py": '"""job"""\n_private_for_old_tests = 1\n',
    })
    assert all(not v for v in all_violations(src).values()), report(all_violations(src))


def test_each_rule_catches_its_violation(tmp_path):
    src = _package(tmp_path, {
        "plan/data.py": '"""pure"""\ndef f():\n    from virtualflow.runtime.engine import Engine  # lazy, still upward\n',
        "runtime/engine.py": '"""engine"""\nimport os\nKEY = os.environ["K"]\n'
                             'from virtualflow.runtime.worker import _helper\n',
        "runtime/worker.py": '"""worker"""\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
                             '    from virtualflow.runtime.engine import Engine\n',
        "gnn/executors.py": '"""gnn"""\nimport multiprocessing as mp\nimport signal\nsignal.signal(15, None)\n'
                            'import os as _os\nDEBUG = _os.getenv("D")\n',
        "control/x.py": '"""ctl"""\nfrom virtualflow import job\n',
        "job.py": '"""Deprecated: moved to :mod:`virtualflow.config.job`; alias."""\nfrom virtualflow.config.job import *\n',
        "config/job.py": '"""job"""\n',
        "supervisor.py": '"""not moved yet"""\n',
        "weird/thing.py": '"""no layer"""\n',
    })
    v = all_violations(src)
    assert len(v["circles"]) == 1 and "virtualflow.runtime.engine" in v["circles"][0] \
        and "type-only" in v["circles"][0], v["circles"]
    assert any("plan/data.py:3" in x and "runtime/, layer 8" in x for x in v["upward imports"]), v
    assert any("control/x.py:2" in x and "shim" in x for x in v["upward imports"]), v
    owners = v["environment and processes outside their owners"]
    assert any("runtime/engine.py:3: os.environ" in x for x in owners), owners
    assert any("gnn/executors.py:2: import multiprocessing" in x for x in owners), owners
    assert any("gnn/executors.py:4: signal.signal" in x for x in owners), owners
    assert any("gnn/executors.py:6: os.getenv" in x for x in owners), owners  # through an alias
    assert any("_helper" in x for x in v["private names imported from another module"]), v
    assert any("virtualflow.config.job instead" in x for x in v["deprecated shims imported inside src"]), v
    unplaced_ = v["modules in no layer"]
    assert any("virtualflow/supervisor.py" in x for x in unplaced_) and any("weird/" in x for x in unplaced_)
    assert not any("job.py" in x for x in unplaced_)  # a shim is placed


def test_a_package_importing_back_from_its_own_init_is_a_circle(tmp_path):
    src = _package(tmp_path, {
        "runtime/__init__.py": '"""pkg"""\nfrom virtualflow.runtime.engine import Engine\nBATCH = 1\n',
        "runtime/engine.py": '"""engine"""\nfrom virtualflow.runtime import BATCH\n',
    })
    found = all_violations(src)["circles"]
    assert len(found) == 1 and "virtualflow.runtime.engine" in found[0], found


def main() -> int:
    found = all_violations(SRC)
    print(report(found))
    total = sum(len(v) for v in found.values())
    print(f"{total} violation(s)" if total else "the layering holds")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
