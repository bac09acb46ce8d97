#!/usr/bin/env bash
# Set up, then run the whole test suite. "No tests collected" (pytest exit code 5) is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export OMP_NUM_THREADS=1
.venv/bin/python -m pytest -q --durations=10 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests (exit code 5)" >&2
    exit 1
fi
exit "$rc"
