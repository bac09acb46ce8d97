"""What one client may take from the dashboard's web server: the transport-level protections.

The dashboard (:mod:`virtualflow.service.dashboard`) runs inside the cluster service's process
when ``cluster start --dashboard-port`` is given, so whatever a client makes the web server hold
(descriptors, memory, log lines) is taken from the scheduler. Invariants kept here:

- **Connections are bounded**: at most :attr:`WebLimits.max_connections` are open at once; one
  more is closed as soon as it is accepted (its descriptor is released at once; the kernel's
  listen backlog, :attr:`WebLimits.backlog`, not this process, holds what waits to be accepted,
  and it bounds one burst of accepts). The server's descriptors peak near ``max_connections +
  backlog`` (96), far below the usual limit (1024): it cannot starve the scheduler of descriptors.
- **Every connection must deliver a whole request in time**: from the moment it is accepted (or
  its previous response completed), a client has :attr:`WebLimits.request_timeout_s` to send the
  request line, the headers and the body; a half-open or trickling connection is then closed.
  A request being answered is never cut. Idle keep-alive connections close after
  :attr:`WebLimits.keep_alive_s` (uvicorn's own timer).
- **Headers are bounded** (:attr:`WebLimits.max_header_bytes`, h11's limit on an incomplete
  event): a head still incomplete past it is answered 400 by uvicorn (what one read delivers,
  at most 256 KiB, is parsed whole).
- **Error logging is rate-limited** (:class:`RateLimitedLog`): a flood of failing or malformed
  requests logs a few lines per window and a count, not one traceback per request.

Body size and the Host header are checked by the application (they need the request);
see :func:`virtualflow.service.dashboard.make_app`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True, slots=True, kw_only=True)
class WebLimits:
    """The dashboard server's limits (``docs/security.md`` lists them)."""

    max_connections: int = 32
    """Open connections at once; one more is closed on accept."""
    backlog: int = 64
    """Connections waiting in the kernel to be accepted (they hold none of this process's
    descriptors). It also bounds how many the event loop accepts in one burst, before any is
    closed for being over ``max_connections``: the server's descriptors peak at about
    ``max_connections + backlog`` (uvicorn's default, 2048, let one burst exhaust a 1024 limit)."""
    request_timeout_s: float = 10.0
    """Time a connection has to send a whole request (line, headers, body)."""
    keep_alive_s: int = 5
    """An idle keep-alive connection is closed after this long."""
    max_header_bytes: int = 16 * 1024
    """A request head still incomplete past this many bytes is refused (h11's
    ``max_incomplete_event_size``)."""
    max_body_bytes: int = 4096
    """A request body (the cancel form); a longer one is refused with 413 before it is read."""
    error_log_burst: int = 5
    """Error/warning lines logged per :attr:`error_log_window_s`; the rest are counted."""
    error_log_window_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "backlog", "keep_alive_s", "max_header_bytes", "max_body_bytes", "error_log_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"WebLimits.{name}={getattr(self, name)!r} must be >= 1")
        for name in ("request_timeout_s", "error_log_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WebLimits.{name}={getattr(self, name)!r} must be > 0")


class RateLimitedLog:
    """A stand-in for uvicorn's error logger that passes at most ``burst`` warnings/errors per
    ``window_s`` to ``logger`` and counts the rest; the first line of the next window says how
    many were dropped. Tracebacks (``exc_info``) travel only with the lines that pass. Debug and
    info lines, and any other attribute, go to ``logger`` unchanged. Thread-safe."""

    def __init__(self, logger: logging.Logger, *, burst: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger, self._burst, self._window_s, self._clock = logger, burst, window_s, clock
        self._lock = threading.Lock()
        self._window_start = -float("inf")
        self._passed = 0
        self.dropped = 0
        """Lines dropped since the last one that passed (a count, for tests and the next line)."""

    def __getattr__(self, name: str) -> Any:  # level, isEnabledFor, handlers... of the real logger
        return getattr(self._logger, name)

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if level < logging.WARNING:
            self._logger.log(level, msg, *args, **kwargs)
            return
        with self._lock:
            now = self._clock()
            if now - self._window_start >= self._window_s:
                self._window_start, self._passed = now, 0
            if self._passed >= self._burst:
                self.dropped += 1
                return
            self._passed += 1
            dropped, self.dropped = self.dropped, 0
        if dropped:
            msg = f"{msg} ({dropped} similar lines in the previous {self._window_s:g} s were not logged)"
        self._logger.log(level, msg, *args, **kwargs)

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, **kwargs)

    def exception(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("exc_info", True)
        self.log(logging.ERROR, msg, *args, **kwargs)

    def critical(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.CRITICAL, msg, *args, **kwargs)


def guarded_protocol(limits: WebLimits, log: RateLimitedLog) -> type:
    """uvicorn's h11 protocol class with the connection cap, the request deadline and the
    rate-limited logger of ``limits``/``log`` (pass it as ``uvicorn.Config(http=...)``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        """One connection. ``_deadline`` is armed while the client owes a request (from accept,
        and again from each completed response) and closes the connection when it fires, unless
        a complete request is being answered."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.logger = log  # uvicorn logs request errors (and their tracebacks) through this
            self._refused = False
            self._deadline: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections:
                self._refused = True
                self.transport = transport
                transport.abort()  # the descriptor goes now; nothing is read from this client
                log.warning("dashboard: %d connections open (the limit): one more was closed",
                            limits.max_connections)
                return
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if not self._refused:
                super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request (keep-alive, pipelined) owes its own deadline

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.request_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            answering = (self.cycle is not None and not self.cycle.response_complete
                         and self.conn.their_state is h11.DONE)
            if answering:  # the whole request arrived: the application's time is not the client's
                self._arm()
                return
            self.transport.close()

    return GuardedH11Protocol
