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

# One pytest run; "no tests collected" (exit code 5) is a failure.
run() {
    .venv/bin/python -m pytest -q --durations=40 "$@"
    local rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "error: pytest collected no tests (exit code 5)" >&2
        return 1
    fi
    return "$rc"
}

if [ "$#" -gt 0 ]; then  # the paths or options given, in this one process
    run "$@"
    exit $?
fi
# tests/e2e one test at a time: each starts processes of its own, so on the 2-core CI machine two
# at once only share the cores (measured: the whole suite on two pytest processes took 2,194 s,
# one process 2,118 s). tests/unit on two pytest processes (pytest-xdist, a test file per unit of
# work: tests/conftest.py): one thread each, they halve (165 s against about 360 s).
# TEST_PROCESSES=0 runs tests/unit in this one process too.
run tests/e2e
rc_e2e=$?
run -n "${TEST_PROCESSES:-2}" --dist loadfile --no-loadscope-reorder tests/unit
rc_unit=$?
if [ "$rc_e2e" -ne 0 ] || [ "$rc_unit" -ne 0 ]; then
    echo "error: tests failed (tests/e2e: exit code $rc_e2e, tests/unit: exit code $rc_unit)" >&2
    exit 1
fi
exit 0
