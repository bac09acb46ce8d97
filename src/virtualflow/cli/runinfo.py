"""What the CLI knows about a run directory: its status file, whether it is still running, and
how to reach its coordinator.

A running job's launcher rewrites ``status.json`` about twice a second (state, step,
generation, workers, recent step times, and the coordinator's loopback address and pid). A
run is *finished* once ``summary.json`` exists or the state is final; a run whose coordinator
process is gone is *orphaned* (continue it with ``virtualflow run ... --resume RUN_DIR``).
"""

from __future__ import annotations

import json
import os
from typing import Any

FINAL_STATES = ("done", "failed", "stopped")


def read_status(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "status.json")
    if not os.path.isdir(run_dir):
        raise ValueError(f"run directory {run_dir!r} does not exist; pass the --run-dir of a 'virtualflow run'")
    if not os.path.exists(path):
        raise ValueError(
            f"{run_dir!r} is not a virtualflow run directory (no status.json); pass the --run-dir of a "
            f"'virtualflow run'"
        )
    with open(path) as f:
        return json.load(f)


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_state(run_dir: str, status: dict[str, Any]) -> str:
    """running | finished (done/failed/stopped) | orphaned."""
    if os.path.exists(os.path.join(run_dir, "summary.json")) or status.get("state") in FINAL_STATES:
        return "finished"
    if not pid_alive(status.get("coordinator", {}).get("pid")):
        return "orphaned"
    return "running"
