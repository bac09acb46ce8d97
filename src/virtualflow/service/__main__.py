"""``python -m virtualflow.service CLUSTER_DIR``: the service process ``virtualflow cluster start``
starts in the background (logging to ``CLUSTER_DIR/service.log``)."""

from __future__ import annotations

import logging
import os
import signal
import sys

from virtualflow.service.runner import Service


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m virtualflow.service CLUSTER_DIR", file=sys.stderr)
        return 2
    cluster_dir = args[0]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        filename=os.path.join(cluster_dir, "service.log"))
    service = Service(cluster_dir)
    signal.signal(signal.SIGTERM, service.request_stop)
    signal.signal(signal.SIGINT, service.request_stop)
    service.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
