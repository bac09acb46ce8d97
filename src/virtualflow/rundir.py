"""The run directory's records: one place that reads and writes them.

Writers: :func:`write_json` (atomic: temp file, then rename). Readers: :func:`read_jsonl`
(tolerates a partial last line, as a crash mid-write leaves), :func:`read_status` and
:func:`read_summary` (a truncated or half-written file is a ``ValueError`` that names the file
and says to retry, never a JSON traceback), :func:`run_state`. Used by the job handle,
``status``, ``resize`` and ``plot``: nothing else opens these files.

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


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (readers see the old or the new file)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every record of a JSONL file ([] if it does not exist). A line that is not a JSON object
    (a partial last line after a crash) is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


def _read_record(path: str, what: str) -> dict[str, Any]:
    """One JSON object from ``path``; a file that is not one is a ``ValueError`` naming it."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        record = json.loads(text)
    except ValueError as exc:
        # A writer that is not atomic (or was killed mid-write, or a copy in progress) leaves a
        # prefix of the record: say so instead of showing a decoder traceback.
        where = f"line {exc.lineno}, column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "?"
        raise ValueError(
            f"{path} is not complete JSON ({len(text)} bytes, unreadable at {where}): it may be in the "
            f"middle of being rewritten; retry in a moment"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds a JSON {type(record).__name__}, not a run's {what} (a JSON object)")
    return record


def read_status(run_dir: str) -> dict[str, Any]:
    """The run's ``status.json``. A missing directory or file, or a truncated or partial file
    (caught while being rewritten), is a ``ValueError`` that says what to do."""
    path = os.path.join(run_dir, "status.json")
    if not os.path.isdir(run_dir):
        raise ValueError(f"run directory {run_dir!r} does not exist; pass the --run-dir of a 'virtualflow run'")
    if not os.path.exists(path):
        raise ValueError(
            f"{run_dir!r} is not a virtualflow run directory (no status.json); pass the --run-dir of a "
            f"'virtualflow run'"
        )
    return _read_record(path, "status")


def read_summary(run_dir: str) -> dict[str, Any] | None:
    """The run's ``summary.json`` (written when the run ends), or None while it has none."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return None
    return _read_record(path, "summary")


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
