"""``python -m bench.bamboo_failover``: runs :func:`bench.bamboo_failover.cli.main`."""

from __future__ import annotations

import sys

from bench.bamboo_failover.cli import main

if __name__ == "__main__":
    sys.exit(main())
