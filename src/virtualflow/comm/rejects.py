"""Logging what was refused, without letting whoever sends it fill the disk.

Everything read from the job's store is untrusted (:mod:`virtualflow.comm.protocol`): what fails
its checks is dropped and logged here. Whoever can write to the store can send as many messages
as they like, as large as the channel allows, so the log is bounded:

* every logged field is cut to :data:`FIELD_CHARS` characters (bytes shown with escapes, never
  decoded blindly), the raw message to its first characters plus its size;
* at most ``per_minute`` refusals of each kind are logged (a warning and an event each) per
  minute; the rest are counted, and the count is logged as one ``rejections_suppressed`` event
  when the minute is over (or at :meth:`RejectLog.flush`, when the job ends).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

FIELD_CHARS = 200
"""Longest logged field (a refused message, a reason, a claimed host name)."""


def short(value: Any, limit: int = FIELD_CHARS) -> Any:
    """``value`` fit for a log: numbers, bools and None as they are, anything else as printable
    text of at most ``limit`` characters (control and non-ASCII characters escaped, so a refused
    message cannot write to the terminal), with the full size when it was cut."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        n, unit = len(raw), "bytes"
        text = raw[:limit].decode("utf-8", "backslashreplace")
    else:
        text = str(value)
        n, unit = len(text), "chars"
        text = text[:limit]
    if not (text.isascii() and text.isprintable()):
        text = "".join(c if c.isascii() and c.isprintable() else c.encode("unicode_escape").decode("ascii")
                       for c in text)
    if n > limit or len(text) > limit:
        return f"{text[:limit]}... ({n} {unit})"
    return text


class RejectLog:
    """Bounded logging of refused messages (see the module docstring). ``record(event, **fields)``
    writes an event (``Coordinator.event``, or a worker's report of it). Each kind of refusal
    (``report_rejected``, ``request_rejected``, ...) has its own budget of ``per_minute``, so a
    flood on one channel does not hide what is refused on another."""

    def __init__(self, record: Callable[..., None] | None, logger: logging.Logger, *, per_minute: int = 30,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.record = record
        self.logger = logger
        self.per_minute = per_minute
        self.clock = clock
        self.logged = 0
        """Refusals logged in full so far."""
        self.suppressed = 0
        """Refusals counted but not logged, in all."""
        self._windows: dict[str, list[float]] = {}  # event -> [window start, logged in it, suppressed unsummarised]

    def __call__(self, event: str, reason: Any, message: Any = None, **fields: Any) -> None:
        """Log one refused message: ``event`` names it (``report_rejected``, ...), ``reason`` says
        why, ``message`` is what was refused (raw), ``fields`` what else is known."""
        now = self.clock()
        w = self._windows.setdefault(event, [now, 0, 0])
        if now - w[0] >= 60.0:
            self._summarise(event, w)
            w[0], w[1] = now, 0
        if w[1] >= self.per_minute:
            w[2] += 1
            self.suppressed += 1
            return
        w[1] += 1
        self.logged += 1
        safe = {k: short(v) for k, v in fields.items()}
        if message is not None:
            safe["message"] = short(message)
            safe.setdefault("bytes", len(message) if hasattr(message, "__len__") else None)
        self.logger.warning("%s: %s%s", event.replace("_", " "), short(reason),
                            "".join(f"; {k}={v}" for k, v in safe.items()))
        if self.record is not None:
            self.record(event, reason=short(reason), **safe)

    def flush(self) -> None:
        """Log the counts of refusals suppressed since the last summaries (if any)."""
        for event, w in self._windows.items():
            self._summarise(event, w)

    def _summarise(self, event: str, w: list[float]) -> None:
        if not w[2]:
            return
        n, w[2] = int(w[2]), 0
        self.logger.warning("%d more %s were not logged (at most %d a minute)", n, event.replace("_", " "),
                            self.per_minute)
        if self.record is not None:
            self.record("rejections_suppressed", of=event, count=n, per_minute=self.per_minute)
