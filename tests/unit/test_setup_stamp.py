"""scripts/setup.sh's stamp: pip is skipped only when pyproject.toml, the interpreter, TORCH_SPEC
and the requested extras are all covered by a stamp written after a successful install.

The script-level tests run the real ``scripts/setup.sh`` in a scratch copy of the repository
whose ``.venv/bin/python`` is a wrapper: ``-m pip ...`` is logged (and fails when asked to),
anything else runs this interpreter. Nothing is installed; each run takes a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_stamp_module():
    spec = importlib.util.spec_from_file_location("setup_stamp", ROOT / "scripts" / "setup_stamp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


S = _load_stamp_module()


# ---------------------------------------------------------------------------------------------
# The stamp's functions.


def test_parse_extras_sorts_and_drops_blanks():
    assert S.parse_extras(" test, plot,,test ") == ["plot", "test"]
    assert S.parse_extras("") == []


def test_fingerprint_changes_with_each_input():
    base = ("[project]\n".encode(), "3.11.2", "/usr/bin/python3.11", "torch==2.13.0")
    fp = S.fingerprint(*base)
    assert fp == S.fingerprint(*base)
    for i, changed in enumerate(("[project]\n# x\n".encode(), "3.12.0", "/opt/py/bin/python3", "torch==2.12.0")):
        args = list(base)
        args[i] = changed
        assert S.fingerprint(*args) != fp, f"input {i} does not reach the fingerprint"
    # length-prefixed parts: moving bytes from one part to the next changes the hash
    assert S.fingerprint(b"ab", "c", "x", "t") != S.fingerprint(b"a", "bc", "x", "t")


def test_stamp_hit_needs_same_fingerprint_and_a_superset_of_extras(tmp_path):
    path = str(tmp_path / "stamp.json")
    assert not S.is_satisfied(path, "fp1", [])  # no stamp: a miss, even for no extras
    assert S.record(path, "fp1", ["digits", "plot"]) == ["digits", "plot"]
    assert S.is_satisfied(path, "fp1", ["digits", "plot"])
    assert S.is_satisfied(path, "fp1", ["plot"])
    assert S.is_satisfied(path, "fp1", [])
    assert not S.is_satisfied(path, "fp1", ["plot", "test"])
    assert not S.is_satisfied(path, "fp2", ["plot"])
    # same fingerprint: extras accumulate (test.sh then train.sh installs nothing more)
    assert S.record(path, "fp1", ["test"]) == ["digits", "plot", "test"]
    assert S.is_satisfied(path, "fp1", ["digits", "test"])
    # a new fingerprint replaces what the old one recorded
    assert S.record(path, "fp2", ["plot"]) == ["plot"]
    assert not S.is_satisfied(path, "fp2", ["test"])


@pytest.mark.parametrize("content", ["", "not json", "[]", '{"fingerprint": 3, "extras": []}',
                                     '{"fingerprint": "fp1", "extras": "plot"}', '{"fingerprint": "fp1"}',
                                     '{"fingerprint": "fp1", "extras": [1]}'])
def test_malformed_stamp_is_a_miss(tmp_path, content):
    path = tmp_path / "stamp.json"
    path.write_text(content)
    assert not S.is_satisfied(str(path), "fp1", [])
    assert S.record(str(path), "fp1", ["plot"]) == ["plot"]  # and is replaced by the next record
    assert json.loads(path.read_text()) == {"fingerprint": "fp1", "extras": ["plot"]}


# ---------------------------------------------------------------------------------------------
# scripts/setup.sh itself, with a fake pip.

FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    echo "$*" >> "$(dirname "$0")/../pip.log"
    exit "${{FAKE_PIP_RC:-0}}"
fi
exec {python} "$@"
"""


@pytest.fixture()
def repo(tmp_path):
    (tmp_path / "scripts").mkdir()
    for name in ("setup.sh", "setup_stamp.py"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    py = tmp_path / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(FAKE_PYTHON.format(python=sys.executable))
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def _setup(repo: Path, extras: str, **env: str) -> tuple[int, list[str]]:
    """Run setup.sh; returns its exit status and the pip commands it ran (this call only)."""
    log = repo / ".venv" / "pip.log"
    before = log.read_text().splitlines() if log.exists() else []
    full_env = {k: v for k, v in os.environ.items() if k != "TORCH_SPEC"}
    full_env.update(env)
    rc = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), extras], env=full_env,
                        capture_output=True, timeout=60).returncode
    after = log.read_text().splitlines() if log.exists() else []
    return rc, after[len(before):]


def test_setup_skips_pip_when_the_stamp_matches(repo):
    rc, pip = _setup(repo, "digits,plot")
    assert rc == 0
    assert len(pip) == 2 and pip[0].endswith("torch==2.13.0") and pip[1].endswith("-e .[digits,plot]"), pip
    assert json.loads((repo / ".venv" / S.STAMP_NAME).read_text())["extras"] == ["digits", "plot"]
    assert _setup(repo, "digits,plot") == (0, [])
    assert _setup(repo, "plot") == (0, [])  # fewer extras: still covered
    rc, pip = _setup(repo, "test")  # a new extra: pip runs, the stamp now covers all three
    assert rc == 0 and pip[-1].endswith("-e .[test]")
    assert _setup(repo, "plot,test,digits") == (0, [])


def test_setup_reinstalls_when_pyproject_or_torch_spec_changes(repo):
    assert _setup(repo, "plot")[0] == 0
    rc, pip = _setup(repo, "plot", TORCH_SPEC="torch==2.12.0")
    assert rc == 0 and pip[0].endswith("torch==2.12.0")
    assert _setup(repo, "plot", TORCH_SPEC="torch==2.12.0") == (0, [])
    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    rc, pip = _setup(repo, "plot", TORCH_SPEC="torch==2.12.0")
    assert rc == 0 and len(pip) == 2


def test_failed_install_writes_no_stamp(repo):
    rc, pip = _setup(repo, "plot", FAKE_PIP_RC="1")
    assert rc != 0 and len(pip) == 1  # set -e: the first failing pip stops the script
    assert not (repo / ".venv" / S.STAMP_NAME).exists()
    rc, pip = _setup(repo, "plot")  # so the next run installs again
    assert rc == 0 and len(pip) == 2
    assert _setup(repo, "plot") == (0, [])


def test_setup_without_extras_installs_the_library_alone(repo):
    rc, pip = _setup(repo, "")
    assert rc == 0 and pip[-1].endswith("-e .")
    assert _setup(repo, "") == (0, [])
    rc, pip = _setup(repo, "plot")  # the library alone does not cover an extra
    assert rc == 0 and pip[-1].endswith("-e .[plot]")
