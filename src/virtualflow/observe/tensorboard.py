"""``--tensorboard``: TensorBoard event files written by the launching process from the step records.

Scalars per step (x axis: the step): ``train/loss``, ``train/samples_per_s``, ``train/step_time_s``,
``cluster/workers`` and ``cluster/generation``; when the step record has them, ``train/tokens_per_s``,
``train/mfu``, ``train/lr``, ``train/grad_norm``, ``train/loss_scale`` and ``train/skipped``
(1 for a step loss scaling skipped), and ``metrics/<name>`` for each of the loss function's
metrics; per broken-down step, ``breakdown/<part>`` (mean
over the workers, seconds) and ``breakdown_worker_<id>/<part>`` (each worker); a resize or a new
generation is also a text entry under ``events`` ("step 12: 2 -> 4 workers, generation 3").
Needs the ``tensorboard`` package (``pip install virtualflow[tensorboard]``): asked for without it,
the run is refused before it starts (:func:`check_available`).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from virtualflow.runtime import breakdown


def check_available() -> None:
    """A ValueError naming the package and the knob when TensorBoard cannot be written."""
    try:
        importlib.import_module("torch.utils.tensorboard")
    except ImportError as exc:
        raise ValueError(f"tensorboard=True (--tensorboard) needs the tensorboard package ({exc}): "
                         f"pip install 'virtualflow[tensorboard]', or drop --tensorboard") from None


class TensorBoardLog:
    """Writes one run's step records to ``folder`` (a TensorBoard log directory)."""

    def __init__(self, folder: str) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.writer = SummaryWriter(log_dir=folder)
        self._workers: int | None = None
        self._generation: int | None = None

    def step(self, record: dict[str, Any]) -> None:
        """One step record (the coordinator's: :data:`virtualflow.control.coordinator.STEP_FIELDS`,
        and breakdown / breakdown_step when measured)."""
        w, step = self.writer, int(record["step"])
        w.add_scalar("train/loss", float(record["loss"]), step)
        t = float(record["step_time_s"])
        w.add_scalar("train/step_time_s", t, step)
        if t > 0:
            w.add_scalar("train/samples_per_s", record["samples"] / t, step)
        for key in ("tokens_per_s", "mfu", "lr", "grad_norm", "loss_scale"):
            if record.get(key) is not None:
                w.add_scalar(f"train/{key}", float(record[key]), step)
        if "skipped" in record:
            w.add_scalar("train/skipped", float(bool(record["skipped"])), step)
        for name, value in (record.get("metrics") or {}).items():
            w.add_scalar(f"metrics/{name}", float(value), step)
        workers, gen = int(record["workers"]), int(record["generation"])
        w.add_scalar("cluster/workers", workers, step)
        w.add_scalar("cluster/generation", gen, step)
        if self._generation is not None and gen != self._generation:
            what = f"{self._workers} -> {workers} workers" if workers != self._workers else f"{workers} workers"
            w.add_text("events", f"step {step}: {what}, generation {gen}", step)
        self._workers, self._generation = workers, gen
        parts = breakdown.clean(record.get("breakdown"))
        at = record.get("breakdown_step")
        if parts is None or not isinstance(at, int):
            return
        for key in breakdown.PARTS + ("step_s",):
            w.add_scalar(f"breakdown/{key}", sum(p[key] for p in parts) / len(parts), at)
            for p in parts:
                w.add_scalar(f"breakdown_worker_{p['worker']}/{key}", p[key], at)
        for key in breakdown.IO_FIELDS:
            w.add_scalar(f"io/{key}", sum(p[key] for p in parts), at)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
