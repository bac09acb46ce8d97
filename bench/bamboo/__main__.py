"""``python -m bench.bamboo``: runs :func:`bench.bamboo.cli.main`."""

from __future__ import annotations

import sys

from bench.bamboo.cli import main

if __name__ == "__main__":
    sys.exit(main())
