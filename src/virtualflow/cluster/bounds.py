"""One validation layer for what the cluster simulators read: traces, spot files, cost files.

Every number a simulation reads is checked here against what it *means*, not just its type: a
job's ``total_steps`` must be a count a job can finish within :data:`MAX_SIM_S` of simulated
time, a spot trace's count must be a number of machines a fleet can have, a pause a number of
seconds shorter than a day. Out-of-range values made the simulators loop for ever (a job of
1e300 steps never finishes, a spot trace of 1e300 s is replayed event by event) or run out of
memory (a spot count of 1e12 instances); wrong types surfaced as Python errors (``true``
accepted as 1, a list as a job type: ``unhashable type``).

Rules:

* numbers are ``int`` or ``float``, never ``bool``; finite; within the field's bounds; integral
  where the field counts things;
* JSON is parsed with a nesting depth limit (:data:`MAX_JSON_DEPTH`), integers of at most
  :data:`MAX_INT_DIGITS` digits and no ``NaN`` / ``Infinity`` constants;
* every error is one line naming the file, the job (or row), the field, the value and the rule:
  ``trace.json: job 3: total_steps=1e+300 must be at most 1e+12 (a job's steps)``.

Pure: no processes, no printing.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

MAX_SIM_S = 10 * 365 * 86400.0
"""Ten years of simulated time: the longest horizon a trace may describe (arrivals, SLOs,
spot traces), and a bound on any job's run time."""

MAX_JOB_RUN_S = 365 * 86400.0
"""A job's run time alone on its fastest accelerator at its own scale: at most one year (Gavel's
longest jobs take about a week)."""

MAX_STEPS = 1e12
"""A job's total steps (a year at about 30,000 steps per second)."""

MAX_GPUS_PER_JOB = 4096
MAX_SPOT_INSTANCES = 100_000
MAX_PAUSE_S = 86400.0
"""A pause or latency of the cluster's machinery (start, resume, resize): at most a day."""

MAX_WEIGHT = 1e6
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 30
MAX_FILE_BYTES = 512 * 1024 * 1024


def number(value: Any, *, where: str, field: str, lo: float, hi: float, integral: bool = False,
           lo_open: bool = False, meaning: str = "") -> float:
    """``value`` checked: a real number (not a bool), finite, in ``[lo, hi]`` (``(lo, hi]`` with
    ``lo_open``), integral when ``integral``. Returns it as a float (an int when integral)."""
    why = f" ({meaning})" if meaning else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {field}={_show(value)} must be a number{why}, not {type(value).__name__}")
    if isinstance(value, int) and len(str(abs(value))) > MAX_INT_DIGITS:
        raise ValueError(f"{where}: {field} is an integer of {len(str(abs(value)))} digits; it must be at most "
                         f"{hi:g}{why}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{where}: {field}={_show(value)} must be a finite number{why}")
    if integral and x != int(x):
        raise ValueError(f"{where}: {field}={_show(value)} must be a whole number{why}")
    if (x <= lo) if lo_open else (x < lo):
        raise ValueError(f"{where}: {field}={_show(value)} must be {'>' if lo_open else '>='} {lo:g}{why}")
    if x > hi:
        raise ValueError(f"{where}: {field}={_show(value)} must be at most {hi:g}{why}")
    return int(x) if integral else x


def text(value: Any, *, where: str, field: str, max_len: int = 200) -> str:
    """A non-empty string of at most ``max_len`` characters."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: {field}={_show(value)} must be a string, not {type(value).__name__}")
    if not value or len(value) > max_len:
        raise ValueError(f"{where}: {field} must be a non-empty string of at most {max_len} characters")
    return value


def _show(value: Any) -> str:
    s = repr(value) if not isinstance(value, float) else f"{value:g}"
    return s if len(s) <= 40 else s[:37] + "..."


def json_depth_ok(data: str, limit: int = MAX_JSON_DEPTH) -> int | None:
    """None when no object or array in ``data`` nests deeper than ``limit``, else the offset where
    it first does (strings are skipped, so brackets inside them do not count)."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(data):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return i
        elif ch in "]}":
            depth -= 1
    return None


def load_json(path: str | os.PathLike, *, what: str) -> Any:
    """A JSON file parsed defensively: at most :data:`MAX_FILE_BYTES`, nesting depth at most
    :data:`MAX_JSON_DEPTH`, integers of at most :data:`MAX_INT_DIGITS` digits, no NaN/Infinity.
    Errors are one line: ``"{what} {path}: ..."``."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot be read ({exc.strerror or exc})") from None
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{what} {path}: {size} bytes; at most {MAX_FILE_BYTES} bytes are read")
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path}: not JSON (byte {exc.start} is not UTF-8 text)") from None
    deep = json_depth_ok(raw)
    if deep is not None:
        raise ValueError(f"{what} {path}: nested deeper than {MAX_JSON_DEPTH} levels (at character {deep}); "
                         f"not a file of this kind")

    def big_int(s: str) -> int:
        if len(s.lstrip("-")) > MAX_INT_DIGITS:
            raise ValueError(f"an integer of {len(s.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
        return int(s)

    def no_constant(s: str) -> Any:
        raise ValueError(f"{s} is not a JSON number (use a finite number)")

    try:
        return json.loads(raw, parse_int=big_int, parse_constant=no_constant)
    except ValueError as exc:  # JSONDecodeError is a ValueError; so are the two above
        raise ValueError(f"{what} {path}: not valid JSON ({str(exc).splitlines()[0]})") from None
