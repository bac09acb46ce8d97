"""A worker: rebuild the job, join the current generation, run steps until told to stop.

The worker is started by a backend with a :class:`WorkerConfig` and its worker id. It talks to
the coordinator only through the job's TCPStore (see :mod:`virtualflow.comm.protocol`):

1. rebuild the job and its dataset, build the model with ``torch.manual_seed(seed)``, report
   ``join`` (all of this before touching any process group);
2. read the generation record, build the generation's group, broadcast parameters and buffers
   from rank 0 (initialisation is identical on every worker, whatever the model factory does);
3. run steps. Rank 0 reads the control sequence number at the start of each step and it travels
   in the step's small all-reduce, so every worker sees the same commands at the same step
   boundary; rank 0 reports each step and runs evaluation.

Any exception is reported with its traceback before the process exits non-zero.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from virtualflow.comm import protocol
from virtualflow.comm.groups import Group, make_group
from virtualflow.job import Job, JobSource
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.checkpoint import save_state
from virtualflow.runtime.engine import BatchLoader, NonFiniteLossError, VNEngine


@dataclass(slots=True)
class WorkerConfig:
    store_host: str
    store_port: int
    job_source: JobSource
    total_steps: int
    state_dir: str
    overrides: dict[str, Any] = field(default_factory=dict)
    deterministic: bool = False
    threads: int = 1
    device: str = "cpu"
    collective_timeout_s: float = 120.0
    store_timeout_s: float = 120.0


def build_job(cfg: WorkerConfig) -> Job:
    job = cfg.job_source.load()
    return job.replace(**cfg.overrides) if cfg.overrides else job


def broadcast_module(module: torch.nn.Module, group: Group, src: int = 0) -> None:
    """Make every worker's parameters and buffers bit-identical to ``src``'s."""
    if group.size == 1:
        return
    tensors = [t for t in list(module.parameters()) + list(module.buffers())]
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            group.broadcast(flat, src)
            offset = 0
            for t in same:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def training_state(job: Job, engine: VNEngine, step: int) -> dict[str, Any]:
    return {
        "model": {k: v.detach().cpu() for k, v in engine.model.state_dict().items()},
        "optimizer": engine.optimizer.state_dict(),
        "lr_scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
        "step": step,
        "job": {
            "name": job.name,
            "global_batch_size": job.global_batch_size,
            "virtual_nodes": job.virtual_nodes,
            "seed": job.seed,
        },
    }


def run_worker(cfg: WorkerConfig, worker_id: int) -> int:
    """Run one worker to completion; returns the process exit code."""
    torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    store = dist.TCPStore(
        cfg.store_host,
        cfg.store_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=cfg.store_timeout_s),
    )
    step = -1
    try:
        _train(cfg, worker_id, store)
        return 0
    except Exception as exc:
        try:
            protocol.push_report(
                store,
                {
                    "type": "error",
                    "worker": worker_id,
                    "pid": os.getpid(),
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                    "step": getattr(exc, "step", step),
                },
            )
        except Exception:
            pass
        return 1


def _train(cfg: WorkerConfig, worker_id: int, store: dist.Store) -> None:
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    job = build_job(cfg)
    dataset = job.build_dataset()
    plan = DataPlan(len(dataset), job.global_batch_size, job.virtual_nodes, job.seed)
    torch.manual_seed(job.seed)
    model = job.model().to(device)
    protocol.push_report(
        store,
        {"type": "join", "worker": worker_id, "pid": os.getpid(), "setup_s": time.perf_counter() - t_start},
    )

    store.wait([protocol.GENERATION_KEY])
    g = int(store.get(protocol.GENERATION_KEY))
    record = protocol.GenerationRecord.from_json(store.get(protocol.generation_key(g)))
    rank = record.members.index(worker_id)
    group = make_group(store, g, rank, len(record.members), cfg.collective_timeout_s, device)
    broadcast_module(model, group)

    optimizer = job.optimizer(model.parameters())
    scheduler = job.lr_scheduler(optimizer) if job.lr_scheduler is not None else None
    engine = VNEngine(
        model,
        optimizer,
        scheduler,
        job.loss,
        plan,
        BatchLoader(dataset, job.collate_fn),
        seed=job.seed,
        batchnorm=job.batchnorm,
        deterministic=cfg.deterministic,
        device=device,
    )
    engine.set_membership(group, record.assignment)

    applied_control = 0
    last_eval_step = -1
    step = record.start_step
    t_prev = time.perf_counter()
    while step < cfg.total_steps:
        control = int(store.get(protocol.CONTROL_SEQ_KEY)) if rank == 0 else 0
        outcome = engine.step(step, control)
        if outcome.bad_vns:
            path = os.path.join(cfg.state_dir, "checkpoint.pt")
            if rank == 0:
                save_state(path, training_state(job, engine, step))
            err = NonFiniteLossError(
                f"non-finite loss at step {step} in virtual node"
                f"{'s' if len(outcome.bad_vns) > 1 else ''} {', '.join(map(str, outcome.bad_vns))}; "
                f"the step was not applied and the last good state (before step {step}) is in {path}. "
                f"Lower the learning rate, check the data of those samples, or clip gradients"
            )
            err.step = step  # type: ignore[attr-defined]
            raise err
        now = time.perf_counter()
        step_time = now - t_prev
        t_prev = now
        if rank == 0:
            protocol.push_report(
                store,
                {
                    "type": "step",
                    "step": step,
                    "loss": outcome.loss,
                    "samples": job.global_batch_size,
                    "step_time_s": step_time,
                    "workers": group.size,
                    "generation": g,
                    "vns": record.assignment,
                    "time": time.time(),
                },
            )
        step += 1
        if rank == 0 and job.evaluate is not None and job.eval_every and step % job.eval_every == 0:
            _evaluate(store, job, engine, step)
            last_eval_step = step
            t_prev = time.perf_counter()  # evaluation time is not step time
        if outcome.control > applied_control:
            stop = False
            for n in range(applied_control + 1, outcome.control + 1):
                command = json.loads(store.get(protocol.control_key(n)))
                if command.get("op") == "stop":
                    stop = True
            applied_control = outcome.control
            if stop:
                break
    if rank == 0:
        if job.evaluate is not None and last_eval_step != step:
            _evaluate(store, job, engine, step)
        save_state(os.path.join(cfg.state_dir, "final.pt"), training_state(job, engine, step))
    protocol.push_report(store, {"type": "done", "step": step, "worker": worker_id, "rank": rank,
                                 "peak_rss_mib": _peak_rss_mib()})
    if group.pg is not None:
        # Nobody leaves before rank 0 has written the final state (a late error is still seen).
        group.all_reduce(torch.zeros(1, device=device))
        group.pg.shutdown()


def _peak_rss_mib() -> float:
    """This process's own peak resident memory (VmHWM). ``ru_maxrss`` is not used: on Linux it
    carries the parent's peak across fork+exec, so a worker would report its launcher's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except Exception:
        return float("nan")


def _evaluate(store: dist.Store, job: Job, engine: VNEngine, step: int) -> None:
    model = engine.model
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        metrics = job.evaluate(model)
    model.train()
    protocol.push_report(
        store,
        {
            "type": "eval",
            "step": step,
            "metrics": {k: float(v) for k, v in dict(metrics).items()},
            "eval_time_s": time.perf_counter() - t0,
        },
    )
