"""Print every layering violation of src/virtualflow at once, grouped by kind.

    python scripts/check_layers.py

The rules, the layer table and the owners of the environment and processes are those of
tests/unit/test_layers.py (this script runs its ``main``); docs/architecture.md explains them.
Exit status 0 when the layering holds, 1 otherwise.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    test = Path(__file__).resolve().parents[1] / "tests" / "unit" / "test_layers.py"
    sys.exit(runpy.run_path(str(test))["main"]())
