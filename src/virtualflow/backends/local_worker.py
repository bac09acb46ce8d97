"""Entry point of a local worker process: ``python -m virtualflow.backends.local_worker CONFIG ID``."""

from __future__ import annotations

import os
import pickle
import sys


def main(argv: list[str]) -> int:
    config_path, worker_id = argv[1], int(argv[2])
    with open(config_path, "rb") as f:
        config = pickle.load(f)
    from virtualflow.runtime.worker import run_worker

    return run_worker(config, worker_id)


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's background threads can abort the process while C++
    # statics are destroyed ("terminate called without an active exception"). All state that
    # matters is already written and reported.
    os._exit(code)
