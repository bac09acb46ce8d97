"""A worker's step-boundary work: checkpoints and evaluations, on behalf of its engine.

:class:`WorkerBoundary` is the worker's side of :class:`virtualflow.runtime.engines.Boundary`:
it knows the run's files and the worker's reports; the engine (:meth:`Engine.boundary`,
:meth:`Engine.boundary_on_rank0`, :meth:`Engine.hold`) decides when its state is assembled and
by whom. Invariants: checkpoint files are named ``checkpoints/step-<8 digits>.pt`` in the run's
state directory and their contents are an engine's whole state plus ``step`` and ``job`` (the
job's name, global batch size, virtual nodes and seed), in that key order, then ``callbacks``
(the job's callbacks' state, :meth:`virtualflow.runtime.callbacks.Callbacks.state_dict`) when a
callback has state; pruning keeps the newest ``keep_checkpoints`` files (and their
``.sha256``; :func:`virtualflow.runtime.checkpoint.prune_state_files`). With ``checkpoint_format="dcp"`` a checkpoint is the folder
``checkpoints/step-<8 digits>.dcp/`` every member writes its part of (:mod:`virtualflow.runtime.
dcp`), with the same contents (the big tensors in chunks, the rest in rank 0's ``meta.pt``);
the worker completing it prunes to ``keep_checkpoints``. An evaluation runs the model in eval
mode without gradients, puts it back in training mode, is reported, then told to the callbacks
(``on_eval``).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from virtualflow.comm import protocol
from virtualflow.comm.groups import Group
from virtualflow.config.job import Job
from virtualflow.runtime.batch_change import parse_rule
from virtualflow.runtime.channel import Reporter
from virtualflow.runtime.checkpoint import prune_state_files, save_state
from virtualflow.runtime.dcp import SUFFIX, DcpSaver, Piece, write_rank
from virtualflow.runtime.worker_config import WorkerConfig

if TYPE_CHECKING:
    from virtualflow.runtime.callbacks import Callbacks
    from virtualflow.runtime.engines import Engine

__all__ = ["WorkerBoundary", "apply_commands", "checkpoint_path", "evaluate", "job_identity"]


def checkpoint_path(state_dir: str, step: int, suffix: str = ".pt") -> str:
    return os.path.join(state_dir, "checkpoints", f"step-{step:08d}{suffix}")


def job_identity(job: Job) -> dict[str, Any]:
    """What a state file records of the job it belongs to."""
    return {
        "name": job.name,
        "global_batch_size": job.global_batch_size,
        "virtual_nodes": job.virtual_nodes,
        "seed": job.seed,
        "data_order": job.data_order,
    }


def evaluate(report: Reporter, job: Job, model: torch.nn.Module, step: int) -> dict[str, float]:
    """``job.evaluate(model)`` without gradients, reported as an ``eval`` event; returns its metrics."""
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        metrics = job.evaluate(model)
    model.train()
    metrics = {str(k): float(v) for k, v in dict(metrics).items()}
    report({"type": "eval", "step": step, "metrics": metrics, "eval_time_s": time.perf_counter() - t0})
    return metrics


class WorkerBoundary:
    """Checkpoints and evaluations of one worker's run (see the module docstring)."""

    def __init__(self, cfg: WorkerConfig, job: Job, report: Reporter, callbacks: Callbacks | None = None) -> None:
        self.cfg, self.job, self.report = cfg, job, report
        self.callbacks = callbacks
        self.last_eval_step = -1
        """The step of the last evaluation (the final state is evaluated unless it was)."""
        self.dcp = cfg.options.checkpoint_format == "dcp"
        """Checkpoints are sharded: every member writes its part (:meth:`save_sharded`)."""
        self.saver = DcpSaver(cfg.options.async_checkpoint) if self.dcp else None
        self.fault_point: Callable[[int, str], None] | None = None
        """Fault injection (:mod:`virtualflow.runtime.faults`): ``during_checkpoint``."""

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.options.checkpoint_every
        return bool(every and step % every == 0 and step < self.cfg.total_steps)

    def eval_due(self, step: int) -> bool:
        job = self.job
        return bool(job.evaluate is not None and job.eval_every and step % job.eval_every == 0)

    def whole_state(self, engine: Engine, group: Group, step: int) -> dict[str, Any] | None:
        state = engine.whole_state(group)
        if state is None:
            return None
        state.update({"step": step, "job": job_identity(self.job)})
        if self.callbacks is not None and self.callbacks.has_state():
            state["callbacks"] = self.callbacks.state_dict()
        return state

    def save_checkpoint(self, step: int, state: dict[str, Any], *, prune: bool) -> str:
        path = checkpoint_path(self.cfg.state_dir, step)
        save_state(path, state)
        if prune:
            prune_state_files(os.path.dirname(path), self.cfg.keep_checkpoints, self.recorded_steps())
        return path

    def recorded_steps(self) -> int | None:
        """Steps the coordinator has recorded (``vf/recorded``), or None when it says nothing.
        On a coordinator cut off by a partition this read blocks, and the worker with it, until
        the heartbeat's watchdog ends the process: no checkpoint is pruned meanwhile."""
        store = getattr(self.report, "store", None)
        if store is None or not store.check([protocol.RECORDED_KEY]):
            return None
        return protocol.parse_seq(store.get(protocol.RECORDED_KEY))

    def checkpointed(self, step: int, path: str, t0: float) -> None:
        self.report({"type": "checkpoint", "step": step, "path": path, "save_s": time.perf_counter() - t0})

    def save_sharded(self, group: Group, step: int, pieces: list[Piece], meta: dict[str, Any] | None) -> str:
        """Every member: write this worker's ``pieces`` (and rank 0's ``meta``, the state without
        its big tensors) as its part of the sharded checkpoint of ``step``; asynchronously with
        ``async_checkpoint`` (this returns once the pieces are copied to host memory). The save
        is named by the launch, generation and step, so that files of an interrupted attempt are
        never taken for this one's."""
        assert self.saver is not None
        final = checkpoint_path(self.cfg.state_dir, step, SUFFIX)
        if meta is not None:
            meta.update({"step": step, "job": job_identity(self.job)})
            if self.callbacks is not None and self.callbacks.has_state():
                meta["callbacks"] = self.callbacks.state_dict()
        save_id = f"{self.cfg.job_id}/g{group.generation}/s{step}"
        rank, world, keep = group.rank, group.size, self.cfg.keep_checkpoints
        os.makedirs(os.path.dirname(final), exist_ok=True)
        point = self.fault_point
        written = (lambda: point(step, "during_checkpoint")) if point is not None else None
        recorded = self.recorded_steps
        self.saver.save(lambda staged: write_rank(final, rank, world, save_id, step, staged, meta, keep, written,
                                                  recorded), pieces)
        return final

    def drain(self) -> None:
        """Wait for a sharded save in flight (before the worker exits, holds or writes a state file)."""
        if self.saver is not None:
            self.saver.drain()

    def evaluate(self, model: torch.nn.Module, step: int) -> None:
        metrics = evaluate(self.report, self.job, model, step)
        self.last_eval_step = step
        if self.callbacks is not None:
            self.callbacks.evaluated(step, metrics)


def apply_commands(engine: Engine, commands: list[dict[str, Any]], worker: int, step: int) -> None:
    """The control commands every member read at the boundary before ``step`` that act on the
    engine: a ``slowdown`` of this ``worker``, a ``batch`` change (V from ``step`` on, the rate
    by its rule: :func:`virtualflow.runtime.batch_change.changed`)."""
    for c in commands:
        if c["op"] == "slowdown" and c["worker"] == worker:
            engine.slowdown = float(c["factor"])
        elif c["op"] == "batch":
            engine.change_batch(step, int(c["virtual_nodes"]), parse_rule(c["lr_rule"]))  # type: ignore[attr-defined]
