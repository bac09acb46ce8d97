#!/usr/bin/env bash
# Create .venv (once) and install virtualflow with its test/plot/example/bench extras. Idempotent.
# PyTorch is pinned and installed first: on this kind of machine torch==2.13.0 is a local CPU
# wheel, while an unpinned torch would pull a multi-GB CUDA build. Override with TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
"${PIP[@]}" -e ".[test,plot,examples,bench]"
