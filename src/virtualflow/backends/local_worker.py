"""Entry point of a local worker process: ``python -m virtualflow.backends.local_worker ID``, its
configuration (a pickled :class:`WorkerConfig`) on stdin, written by the launching process.

:func:`preemption_notice` is shared by every backend's worker entry (local, Ray actors,
``virtualflow worker``): SIGTERM while training is a preemption notice."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading


def preemption_notice():
    """Install the SIGTERM handling of a worker process (:class:`PreemptionNotice`: a SIGTERM while
    training is a preemption notice, at any other time it ends the process) and return it; ``None``
    off the main thread, where Python cannot install signal handlers (a worker then dies on
    SIGTERM, as before: the loss is handled as a failure)."""
    from virtualflow.runtime.worker import PreemptionNotice

    if threading.current_thread() is not threading.main_thread():
        return None
    notice = PreemptionNotice()
    signal.signal(signal.SIGTERM, notice.handler)
    return notice


def main(argv: list[str]) -> int:
    worker_id = int(argv[1])
    config = pickle.loads(sys.stdin.buffer.read())
    from virtualflow.runtime.worker import run_worker

    return run_worker(config, worker_id, preemption_notice())


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's background threads can abort the process while C++
    # statics are destroyed ("terminate called without an active exception"). All state that
    # matters is already written and reported.
    os._exit(code)
