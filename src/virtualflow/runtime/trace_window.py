"""``--profile STEPS``: a ``torch.profiler`` trace of a window of steps on one worker.

Each worker traces steps ``[first, last)`` of the run (counted in optimizer steps) and writes
``<folder>/worker-<id>-steps-<first>-<last>.json`` in the Chrome trace format (open it in
Perfetto, ``chrome://tracing`` or TensorBoard's profile plugin). CPU activity always, CUDA's too on
a GPU. Steps are marked with ``record_function("step N")`` ranges, so the trace shows the VNs'
forward, backward, the reduction and the update inside each step.

A window the run never reaches writes nothing; a worker that joins mid-window traces the rest of
it. The profiler's own cost lands in the traced steps only (their breakdown shows it).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

__all__ = ["StepProfiler"]

logger = logging.getLogger(__name__)


class StepProfiler:
    """Starts ``torch.profiler`` before step ``first`` and writes the trace after step ``last - 1``."""

    def __init__(self, window: tuple[int, int], folder: str, worker_id: int, device_type: str = "cpu") -> None:
        self.first, self.last = window
        self.folder = folder
        self.worker_id = worker_id
        self.device_type = device_type
        self._prof: Any = None
        self._range: Any = None
        self.path: str | None = None
        """Where the trace was written (once it was)."""

    def before(self, step: int) -> None:
        if self.path is not None or not self.first <= step < self.last:
            return
        if self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.device_type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, record_shapes=False)
            self._prof.__enter__()
            self._start = step
        from torch.profiler import record_function

        self._range = record_function(f"step {step}")
        self._range.__enter__()

    def after(self, step: int) -> None:
        if self._prof is None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self._done = step
        if step + 1 >= self.last:
            self._write(step + 1)

    def _write(self, end: int) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"worker-{self.worker_id}-steps-{self._start}-{end - 1}.json")
        prof.export_chrome_trace(path)
        self.path = path
        logger.info("profiler trace of steps %d-%d written to %s", self._start, end - 1, path)

    def close(self) -> None:
        """The worker leaves or the run ends inside the window: write what was traced."""
        if self._prof is not None:
            with contextlib.suppress(Exception):
                if self._range is not None:
                    self._range.__exit__(None, None, None)
                    self._range = None
                self._write(getattr(self, "_done", self._start) + 1)
