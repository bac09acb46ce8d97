#!/usr/bin/env bash
# Create .venv (once) and install virtualflow with the extras named in $1 (comma-separated, e.g.
# "test,plot"; none: the library alone). Idempotent, and skips pip entirely when nothing changed:
# .venv/virtualflow-setup.json (scripts/setup_stamp.py) records a fingerprint of pyproject.toml,
# the interpreter and TORCH_SPEC with the extras installed; it is written only after every pip
# command succeeded, so a failed or interrupted install runs again next time.
# PyTorch is pinned and installed first: on this kind of machine torch==2.13.0 is a local CPU
# wheel, while an unpinned torch would pull a multi-GB CUDA build. Override with TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${1:-}
export TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
STAMP=(.venv/bin/python scripts/setup_stamp.py)
# One line on stderr when set-up ends (bench/first_hour.py times set-up by it).
if [ -x .venv/bin/python ] && "${STAMP[@]}" check "$EXTRAS" 2>/dev/null; then
    echo "setup.sh: .venv is up to date${EXTRAS:+ (extras: $EXTRAS)}" >&2
    exit 0
fi
START=$SECONDS
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "$TORCH_SPEC"
"${PIP[@]}" -e ".${EXTRAS:+[$EXTRAS]}"
"${STAMP[@]}" record "$EXTRAS"
echo "setup.sh: installed${EXTRAS:+ with extras $EXTRAS} in $((SECONDS - START)) s" >&2
