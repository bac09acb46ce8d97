"""The project's size limits and the one-step-core ratchet are tests (docs/architecture.md,
"Size limits" and "One home per concern").

* No module of ``src/virtualflow`` over 600 lines, no class over 400, no function of the training
  path (``runtime/``, the worker) over 80, unless its docstring says why in a sentence that starts
  ``Why over N lines:`` (the module's, the class's or the function's own docstring).
* The branches of ``src/virtualflow/runtime`` whose condition names a layout concept (sharded,
  tensor, precision, pipelined, deterministic; ``scripts/count_branches.py``) stay at most
  :data:`BRANCH_CEILING`: a layout is chosen once, when a step's objects are built, and the
  training path asks the objects. Lower the ceiling when a change removes branches; raising it
  needs a reason in the commit.

Everything is read with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "virtualflow"
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 600, 400, 80
TRAINING_PATH = ("runtime",)
"""Folders of ``src/virtualflow`` whose functions are held to :data:`FUNCTION_LINES`."""
BRANCH_CEILING = 68
"""Branches naming a layout concept in ``src/virtualflow/runtime`` (156 before the one-step core, 69 after it, 68 with the loss weighting shared)."""


def _why(doc: str | None, limit: int) -> bool:
    return bool(doc) and re.search(rf"Why over {limit} lines:\s*\S", doc) is not None


def oversized() -> list[str]:
    """One line per module, class or training-path function over its limit without a reason."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        src = path.read_text()
        tree = ast.parse(src)
        n = src.count("\n")
        if n > MODULE_LINES and not _why(ast.get_docstring(tree), MODULE_LINES):
            out.append(f"virtualflow/{rel}: {n} lines (module limit {MODULE_LINES})")
        training = rel.parts[0] in TRAINING_PATH
        for node in ast.walk(tree):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and size > CLASS_LINES and not _why(ast.get_docstring(node),
                                                                                 CLASS_LINES):
                out.append(f"virtualflow/{rel}:{node.lineno}: class {node.name} has {size} lines "
                           f"(limit {CLASS_LINES})")
            elif (training and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > FUNCTION_LINES
                  and not _why(ast.get_docstring(node), FUNCTION_LINES)):
                out.append(f"virtualflow/{rel}:{node.lineno}: {node.name}() has {size} lines "
                           f"(training-path limit {FUNCTION_LINES})")
    return out


def test_no_module_class_or_training_function_over_its_limit_without_a_reason():
    found = oversized()
    assert not found, ("over the size limits (split it, or say why in a docstring sentence 'Why over N lines: "
                       "...'):\n  " + "\n  ".join(found))


def test_the_reason_must_be_a_sentence():
    assert _why("Why over 80 lines: the schedule's loop reads one state.", 80)
    assert not _why("Why over 80 lines:", 80)
    assert not _why("Why one class of about 500 lines.", 400)


def _count_branches():
    spec = importlib.util.spec_from_file_location("count_branches", ROOT / "scripts" / "count_branches.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_runtime_branches_naming_a_layout_stay_under_the_ceiling():
    total, by_file = _count_branches().count([SRC / "runtime"])
    worst = sorted(by_file.items(), key=lambda kv: -sum(kv[1].values()))[:5]
    assert sum(total.values()) <= BRANCH_CEILING, (
        f"{sum(total.values())} branches in runtime/ name a layout concept ({dict(total)}), over the ceiling "
        f"{BRANCH_CEILING}: choose the layout once, when the step's objects are built. Most: "
        + "; ".join(f"{Path(f).name} {sum(c.values())}" for f, c in worst))


def test_the_branch_counter_sees_each_concept(tmp_path):
    cb = _count_branches()
    src = ("if self.shard is not None: pass\n"
           "x = 1 if self.planes is None else 2\n"
           "while self.scaler is not None: pass\n"
           "y = [p for p in ps if job.pipeline is not None]\n"
           "if self.deterministic and torch.tensor(1): pass\n"
           "if torch.tensor(1): pass\n")
    tmp = tmp_path / "probe.py"
    tmp.write_text(src)
    total, _ = cb.count([tmp])
    assert dict(total) == {"sharded": 1, "tensor": 1, "precision": 1, "pipelined": 1, "deterministic": 1}
