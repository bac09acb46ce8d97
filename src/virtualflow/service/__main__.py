"""``python -m virtualflow.service CLUSTER_DIR``: the service process ``virtualflow cluster start``
starts in the background (logging to ``CLUSTER_DIR/service.log``)."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import sys

from virtualflow.service.failures import SERVICE_FREE_BYTES, disk_full
from virtualflow.service.runner import Service


def raise_descriptor_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit: the service holds the
    database, each job driver's pipes and the dashboard's connections (which the dashboard caps),
    and a start refused for want of descriptors only delays a job (it is retried after a back-off)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        pass  # not allowed here: the soft limit stands


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m virtualflow.service CLUSTER_DIR", file=sys.stderr)
        return 2
    cluster_dir = args[0]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        filename=os.path.join(cluster_dir, "service.log"))
    raise_descriptor_limit()
    try:
        service = Service(cluster_dir)
        signal.signal(signal.SIGTERM, service.request_stop)
        signal.signal(signal.SIGINT, service.request_stop)
        service.run()
    except (OSError, sqlite3.OperationalError) as exc:
        if not disk_full(exc):
            raise
        # Out of space before the service could pause (its lock file, its first write): one line,
        # nothing recorded; the next start recovers every job from its run directory.
        line = (f"cluster service in {cluster_dir} cannot start: {' '.join(str(exc).split())}; free at least "
                f"{SERVICE_FREE_BYTES // 2**20} MiB on that file system and start it again")
        logging.getLogger("virtualflow.service").error("%s", line)
        print(line, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
