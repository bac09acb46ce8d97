#!/usr/bin/env bash
# The GPU check, in one command on a machine with one CUDA GPU (under 20 minutes on an H100):
#   1. the gpu-marked tests (tests/e2e/test_gpu.py, and any other test marked gpu),
#   2. the GPU sections of the benchmarks (python -m bench.training_loop --device cuda),
# writing bench/results/gpu/: one log per part, the benchmark's JSON and markdown, and SUMMARY.md
# (what ran, on which device and torch, what passed and what failed). docs/gpu.md describes it.
#
#   bash scripts/gpu-check.sh              # everything
#   bash scripts/gpu-check.sh --quick      # the benchmark's --quick (fewer steps, same targets)
#
# It installs nothing: it uses .venv/bin/python (override with PYTHON=...), which needs a CUDA
# build of torch (scripts/setup.sh pins the CPU wheel on CPU-only machines). It stops at once,
# with exit status 3 and bench/results/gpu/ untouched, when that torch sees no GPU. Otherwise it runs every part even when one
# fails, and exits 1 when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=bench/results/gpu
QUICK=""
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK="--quick" ;;
        *) echo "usage: bash scripts/gpu-check.sh [--quick]" >&2; exit 2 ;;
    esac
done
if [ ! -x "$PYTHON" ] && ! command -v "$PYTHON" >/dev/null; then
    echo "no python at $PYTHON: run bash scripts/setup.sh (with a CUDA torch) or set PYTHON=..." >&2
    exit 3
fi
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    msg="no GPU: torch.cuda.is_available() is False for $PYTHON ($("$PYTHON" -c 'import torch; print("torch", torch.__version__, "CUDA build", torch.version.cuda)' 2>&1))"
    echo "$msg; nothing run, $OUT left as it was" >&2
    exit 3
fi

DEVICE=$("$PYTHON" - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
print(f"{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
EOF
)
echo "GPU check on: $DEVICE"
START=$(date +%s)
FAILED=0

# 1. the gpu tests (-rA: every test's outcome in the log's summary)
timeout 900 "$PYTHON" -m pytest -m gpu -q -rA -p no:cacheprovider tests/e2e/test_gpu.py \
    > "$OUT/tests.log" 2>&1
TESTS_RC=$?
[ "$TESTS_RC" -eq 0 ] || FAILED=1
T_TESTS=$(( $(date +%s) - START ))

# 2. the benchmarks' GPU sections (their tables: bench/results/gpu/training_loop.{json,md})
timeout 900 "$PYTHON" -m bench.training_loop --device cuda --out "$OUT" $QUICK --threads "$OMP_NUM_THREADS" \
    > "$OUT/bench_training_loop.log" 2>&1
BENCH_RC=$?
[ "$BENCH_RC" -eq 0 ] || FAILED=1
T_ALL=$(( $(date +%s) - START ))

outcome() { case "$1" in 0) echo "passed" ;; 1) echo "FAILED (a test failed / a target was missed)" ;;
            124) echo "FAILED (timed out)" ;; *) echo "FAILED (exit status $1)" ;; esac; }
{
    echo "# GPU check"
    echo
    echo "- device: $DEVICE"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); took ${T_ALL} s (tests ${T_TESTS} s)"
    echo
    echo "| part | command | result | log |"
    echo "|---|---|---|---|"
    echo "| gpu tests | \`pytest -m gpu tests/e2e/test_gpu.py\` | $(outcome $TESTS_RC) | tests.log |"
    echo "| benchmark GPU sections | \`python -m bench.training_loop --device cuda $QUICK\` | $(outcome $BENCH_RC) | bench_training_loop.log, training_loop.{json,md} |"
    echo
    echo "## Tests"
    echo
    echo '```'
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|passed|failed" "$OUT/tests.log" | tail -n 30
    echo '```'
    echo
    echo "## Benchmark targets"
    echo
    echo '```'
    sed -n '/^targets of/,$p' "$OUT/bench_training_loop.log"
    echo '```'
} > "$OUT/SUMMARY.md"
cat "$OUT/SUMMARY.md"
exit "$FAILED"
