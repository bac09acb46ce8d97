#!/usr/bin/env bash
# The main job: set up (only what it needs: scikit-learn for the digits, matplotlib for `virtualflow
# plot`; nothing when already set up), then train the digits CNN on 2 local workers (extra args are passed on).
# --overwrite: a second run moves the first one's files into runs/digits/previous-<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh digits,plot
exec .venv/bin/virtualflow run examples/digits.py --workers 2 --epochs 5 --run-dir runs/digits --overwrite "$@"
