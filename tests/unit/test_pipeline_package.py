"""The pipeline runtime package and the public ``parallel`` package keep their shape: the pipeline
package keeps the names others import, ``parallel/`` imports only ``plan/`` from virtualflow, and no
module of the pipeline runtime reads the environment."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "virtualflow"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_the_pipeline_package_keeps_the_names_others_import():
    import virtualflow.runtime.pipeline as p

    for name in ("AllSum", "Expect", "MsgKey", "Poll", "Recv", "Send", "StageEngine", "StageSum", "StageTree",
                 "StepResult", "Reuse", "Eager", "idle_slots", "schedule_for", "_Reuse", "_Eager"):
        assert hasattr(p, name), name


def test_parallel_imports_only_plan():
    for path in (SRC / "parallel").glob("*.py"):
        inside = {m for m in _imports(path) if m.startswith("virtualflow")}
        bad = {m for m in inside if not m.startswith(("virtualflow.plan", "virtualflow.parallel"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_the_pipeline_runtime_reads_no_environment():
    for path in (SRC / "runtime" / "pipeline").glob("*.py"):
        text = path.read_text()
        # os.path for files is fine (the worker engine writes its timeline); the environment is not
        assert "os.environ" not in text and "getenv" not in text, path.name
