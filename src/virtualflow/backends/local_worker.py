"""Entry point of a local worker process: ``python -m virtualflow.backends.local_worker ID``, its
configuration (a pickled :class:`WorkerConfig`) on stdin, written by the launching process."""

from __future__ import annotations

import os
import pickle
import sys


def main(argv: list[str]) -> int:
    worker_id = int(argv[1])
    config = pickle.loads(sys.stdin.buffer.read())
    import signal

    from virtualflow.runtime.worker import PreemptionNotice, run_worker

    notice = PreemptionNotice()
    signal.signal(signal.SIGTERM, notice.handler)  # while training: a preemption notice
    return run_worker(config, worker_id, notice)


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's background threads can abort the process while C++
    # statics are destroyed ("terminate called without an active exception"). All state that
    # matters is already written and reported.
    os._exit(code)
