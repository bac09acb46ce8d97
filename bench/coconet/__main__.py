"""``python -m bench.coconet``: runs :func:`bench.coconet.cli.main`."""

from __future__ import annotations

import sys

from bench.coconet.cli import main

if __name__ == "__main__":
    sys.exit(main())
