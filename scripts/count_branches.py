"""Count the branches whose condition names a layout concept, per concept and per module.

    python scripts/count_branches.py [ROOT ...] [--by-file] [--json]

A *branch* is the test of an ``if``/``elif``, a conditional expression (``a if c else b``), a
``while``, or an ``if`` of a comprehension. It *names* a concept when the test's source text
matches the concept's pattern (below). ROOT defaults to ``src/virtualflow/runtime``. The one-step
core's goal (docs/architecture.md, "One home per concern") is that a layout is chosen once, when
the objects of a step are built, and not asked again in the training path: this script measures
how often it is still asked.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import Counter
from pathlib import Path

CONCEPTS = {
    "sharded": r"shard|scatter",
    "tensor": r"\.tensor\b(?!\s*\()|\btensor\s*[><=!]|\btp\b|tensor_(?:parallel|group|rank|size|stage|sum|sharded)|\bplanes?\b|plane_|TensorStage",
    "precision": r"precision|scaler|autocast|found_inf|mixed|bf16|fp16|float16|\bamp\b|loss_scale",
    "pipelined": r"pipelin",
    "deterministic": r"determin|_det\b|_det_|\.tree\b",
}
"""Concept -> regular expression searched in a branch's test (``torch.tensor(...)`` calls excluded)."""


def _tests(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def count(paths: list[Path]) -> tuple[Counter, dict[str, Counter]]:
    """(branches per concept, per file: branches per concept) over the ``.py`` files under ``paths``."""
    total: Counter = Counter()
    by_file: dict[str, Counter] = {}
    patterns = {name: re.compile(rx) for name, rx in CONCEPTS.items()}
    for root in paths:
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for f in files:
            src = f.read_text()
            here: Counter = Counter()
            for test in _tests(ast.parse(src)):
                text = ast.get_source_segment(src, test) or ""
                for name, rx in patterns.items():
                    if rx.search(text):
                        here[name] += 1
            if here:
                by_file[str(f)] = here
                total.update(here)
    return total, by_file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="*", default=["src/virtualflow/runtime"])
    ap.add_argument("--by-file", action="store_true", help="also print each file's counts")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    total, by_file = count([Path(r) for r in args.roots])
    if args.json:
        print(json.dumps({"total": dict(total), "sum": sum(total.values()),
                          "by_file": {k: dict(v) for k, v in by_file.items()}}, sort_keys=True))
        return 0
    if args.by_file:
        for f, c in sorted(by_file.items(), key=lambda kv: -sum(kv[1].values())):
            print(f"{sum(c.values()):4d}  {f}  " + " ".join(f"{k}={v}" for k, v in sorted(c.items())))
    for name in CONCEPTS:
        print(f"{name:14s}{total.get(name, 0):5d}")
    print(f"{'all':14s}{sum(total.values()):5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
