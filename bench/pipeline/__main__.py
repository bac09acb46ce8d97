"""``python -m bench.pipeline``: runs :func:`bench.pipeline.cli.main`."""

from __future__ import annotations

import sys

from bench.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
