"""Bytes in use by the C allocator, process-wide, and their peak over a stretch of a worker's run.

Purpose: a memory figure "measured by the allocator" for processes whose tensors are allocated on
more than one thread. PyTorch's CPU tensors come from glibc's ``malloc`` (``posix_memalign``),
whose own statistics (``mallinfo2``: ``uordblks``, the bytes in use in its arenas, plus
``hblkhd``, the bytes of the chunks it mapped on their own) count every live allocation of every
thread, and nothing it has freed (unlike RSS, which keeps what the allocator holds after a free).

Why not ``torch.profiler.profile(profile_memory=True)``: its memory events are recorded only on the
thread that started the profiler (PyTorch 2.13), so a tensor allocated or freed on another thread
(virtualflow's reduction thread frees each unit's gradient there; gloo's threads allocate) is
missed, and with ``profile_all_threads=True`` it records no memory event at all (both measured).

:class:`PeakSampler` reads the figure every ``period_s`` on a thread of its own (a ``ctypes`` call
releases the GIL) between :meth:`start` and :meth:`stop`; the peak it reports is the largest
sample, so a peak shorter than the period can be missed (it is a lower bound, close for the
step-long peaks measured here: a unit's gathered parameters and gradient live for its whole
backward). Invariant: without glibc (``available()`` False) every figure is None, never a guess.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

__all__ = ["PeakSampler", "available", "in_use_bytes"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = lib.mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None
    fn.restype = _Mallinfo2
    return fn


_MALLINFO2 = _libc()


def available() -> bool:
    return _MALLINFO2 is not None


def in_use_bytes() -> int | None:
    """Bytes the allocator has handed out and not taken back, all threads (None without glibc)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class PeakSampler:
    """The largest :func:`in_use_bytes` read every ``period_s`` between :meth:`start` and :meth:`stop`."""

    def __init__(self, period_s: float = 0.0005) -> None:
        self.period_s = period_s
        self.start_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PeakSampler":
        self.start_bytes = self.peak_bytes = in_use_bytes()
        if self.start_bytes is not None:
            self._thread = threading.Thread(target=self._run, name="alloc-peak-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            now = in_use_bytes()
            self.samples += 1
            if now > self.peak_bytes:
                self.peak_bytes = now
            time.sleep(self.period_s)

    def stop(self) -> "PeakSampler":
        """Stop sampling (the figure now counts too); returns self."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, in_use_bytes())
        return self
