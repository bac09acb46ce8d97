"""The set-up stamp: lets ``scripts/setup.sh`` skip pip when nothing it installs from has changed.

``setup.sh`` runs this with the virtual environment's own interpreter (``.venv/bin/python``), so
the interpreter's version is the one the packages were installed for. The stamp file
(``.venv/virtualflow-setup.json``) holds a fingerprint and the extras installed under it::

    {"fingerprint": "<sha256>", "extras": ["plot", "digits"]}

The fingerprint is the SHA-256 of ``pyproject.toml``'s bytes, the interpreter's version and
executable, and ``TORCH_SPEC``. Invariants:

* ``check`` succeeds only when the stamp's fingerprint equals the current one and every requested
  extra is among the stamp's extras (``train.sh`` after ``test.sh`` installs nothing more);
  a missing, unreadable or malformed stamp is a miss (the stamp is untrusted: it is a file).
* ``record`` is called by ``setup.sh`` only after every pip command succeeded, so a broken or
  partial install never looks done. Under the same fingerprint it adds the new extras to the
  recorded ones; under a new fingerprint it replaces them.
* The editable install (``pip install -e``) follows source edits by itself; only
  ``pyproject.toml`` (dependencies, extras, entry points) needs a re-install.

Usage (exit 0 on a hit, 1 on a miss)::

    .venv/bin/python scripts/setup_stamp.py check  --stamp .venv/virtualflow-setup.json test,plot
    .venv/bin/python scripts/setup_stamp.py record --stamp .venv/virtualflow-setup.json test,plot
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

STAMP_NAME = "virtualflow-setup.json"


def parse_extras(text: str) -> list[str]:
    """``"test, plot,,"`` -> ``["plot", "test"]``: comma-separated, blanks dropped, sorted, unique."""
    return sorted({e.strip() for e in text.split(",") if e.strip()})


def fingerprint(pyproject: bytes, python_version: str, executable: str, torch_spec: str) -> str:
    """What an install depends on besides the extras: a change to any part forces pip to run."""
    h = hashlib.sha256()
    for part in (pyproject, python_version.encode(), executable.encode(), torch_spec.encode()):
        h.update(len(part).to_bytes(8, "big"))  # length-prefixed: no two inputs hash alike by shifting bytes
        h.update(part)
    return h.hexdigest()


def current_fingerprint(pyproject_path: str, torch_spec: str) -> str:
    with open(pyproject_path, "rb") as f:
        data = f.read()
    return fingerprint(data, sys.version, os.path.realpath(sys.executable), torch_spec)


def read_stamp(path: str) -> tuple[str, list[str]] | None:
    """The stamp's (fingerprint, extras), or None when it is missing or not a valid stamp."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    fp, extras = data.get("fingerprint"), data.get("extras")
    if not isinstance(fp, str) or not isinstance(extras, list) or not all(isinstance(e, str) for e in extras):
        return None
    return fp, extras


def is_satisfied(path: str, fp: str, extras: list[str]) -> bool:
    """True when the stamp at ``path`` was recorded under ``fp`` with every one of ``extras``."""
    stamp = read_stamp(path)
    return stamp is not None and stamp[0] == fp and set(extras) <= set(stamp[1])


def record(path: str, fp: str, extras: list[str]) -> list[str]:
    """Write the stamp after a successful install; returns the extras it now records."""
    stamp = read_stamp(path)
    keep = set(stamp[1]) if stamp is not None and stamp[0] == fp else set()
    merged = sorted(keep | set(extras))
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"fingerprint": fp, "extras": merged}, f)
    os.replace(tmp, path)  # atomic: an interrupted write leaves the old stamp or none
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("action", choices=("check", "record"))
    p.add_argument("extras", nargs="?", default="", help="comma-separated extras, e.g. test,plot")
    p.add_argument("--stamp", default=os.path.join(".venv", STAMP_NAME))
    p.add_argument("--pyproject", default="pyproject.toml")
    args = p.parse_args(argv)
    fp = current_fingerprint(args.pyproject, os.environ.get("TORCH_SPEC", ""))
    extras = parse_extras(args.extras)
    if args.action == "check":
        return 0 if is_satisfied(args.stamp, fp, extras) else 1
    record(args.stamp, fp, extras)
    return 0


if __name__ == "__main__":
    sys.exit(main())
