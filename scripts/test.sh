#!/usr/bin/env bash
# Set up with the test extras (and the main job's, so train.sh after it installs nothing), then
# run the whole test suite. "No tests collected" (pytest exit code 5) is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,plot,examples,bench,digits || exit 1
# tests/e2e/test_service_dashboard.py drives the OS's Chromium (never a downloaded browser): install the
# Debian package when it is missing and we are root (idempotent; without it that test fails).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
        || echo "warning: could not install chromium; tests/e2e/test_service_dashboard.py will fail" >&2
fi
export OMP_NUM_THREADS=1
# Two pytest processes (pytest-xdist), one per core of the 2-core CI machine, each running one test
# file at a time, in collection order (e2e files first, the many short unit files last fill the
# end); the hosts tests and the Ray tests each as one unit, one file after the other
# (tests/conftest.py). TEST_PROCESSES=0 runs everything in this one process.
.venv/bin/python -m pytest -q -n "${TEST_PROCESSES:-2}" --dist loadfile --no-loadscope-reorder --durations=40 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests (exit code 5)" >&2
    exit 1
fi
exit "$rc"
