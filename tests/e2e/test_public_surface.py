"""The declared public surface (docs/architecture.md): the public packages import without touching
a deprecated alias, and every alias of a moved module (none today: the aliases of the first reshape
were removed before any release shipped them) still works, warns once with its new home, and hands
out the very objects of that home.

One short subprocess (a fresh interpreter: an alias warns only at its first import, and the test
process has imported virtualflow long before)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "virtualflow"
PUBLIC = ("virtualflow", "virtualflow.parallel", "virtualflow.gnn", "virtualflow.cluster", "virtualflow.plan.comm")


def _aliases() -> dict[str, str]:
    """Alias module -> its docstring's first line (which names the new home)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if doc.startswith("Deprecated:"):
            rel = path.relative_to(SRC.parent).with_suffix("")
            out[".".join(rel.parts)] = doc
    return out


PROBE = r"""
import importlib, json, sys, warnings
public, aliases = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {"public": [], "aliases": {}}
with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)  # the public surface uses no alias
    for name in public:
        mod = importlib.import_module(name)
        for attr in getattr(mod, "__all__", ()):
            getattr(mod, attr)
        out["public"].append(name)
for name in aliases:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(name)
    msgs = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    names = list(getattr(mod, "__all__", ())) or [n for n in vars(mod) if not n.startswith("_")]
    missing = [n for n in names if not hasattr(mod, n)]
    out["aliases"][name] = {"warnings": msgs, "missing": missing, "names": len(names)}
print(json.dumps(out))
"""


def test_public_packages_use_no_alias_and_every_alias_warns_with_its_new_home():
    aliases = _aliases()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(PUBLIC), json.dumps(sorted(aliases))],
                       capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["public"] == list(PUBLIC)
    for name, doc in aliases.items():
        got = out["aliases"][name]
        assert got["names"] > 0 and got["missing"] == [], (name, got)
        assert len(got["warnings"]) == 1, (name, got["warnings"])
        (msg,) = got["warnings"]
        assert msg.startswith(f"{name} is deprecated; import virtualflow."), msg
        # the new home the warning names is the one the alias's docstring names
        new_home = msg.split("; import ", 1)[1].split()[0].rstrip(",")
        assert new_home in doc, (name, new_home, doc)
