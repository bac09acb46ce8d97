"""Bamboo's redundant stages (issue 16): what ``Pipeline(redundancy=True)`` costs a pipelined job
trained through ``virtualflow.train``, the restart/checkpoint times, and the constants the spot
simulator (``virtualflow simulate-spot``) reads from ``bench/results/bamboo.json``.

What exists in the engine (and so what this measures): every worker keeps a replica of its
successor's stage, refreshed every step from the successor's reduced gradients (one extra
point-to-point message of the stage's gradient size per worker per step, sent after the
reduction and before the step commits, and a duplicate optimizer step on the replica); by
default (``redundant_compute="eager"``) each worker also runs its successor stage's forward of
the micro-batches it sent on the replica, only in the schedule's bubbles (the others skipped,
counted), and keeps them until the step commits (``redundant_compute="lazy"``: none). A lost middle worker is
covered by its predecessor, which runs the lost stage from its replica (failover, the
interrupted step redone, splicing in the eager forwards it holds). The reconfiguration pause and
the trace replay are measured by ``bench.bamboo_failover``, not here.

1. **Redundancy overhead.** The same job without redundancy, with lazy redundancy
   (``Pipeline(redundancy=True, redundant_compute="lazy")``: the refresh alone) and with eager
   redundancy (``Pipeline(redundancy=True)``, the default), ``virtualflow.train`` (local
   backend, one worker process per stage, 1 thread each), 1F1B, interleaved triples (the order
   rotated over the 6 permutations), per run the median step time after warm-up; overhead =
   median over triples of (step eager / step without): target <= 1.15 (key
   ``redundancy_overhead``); lazy beside it (key ``redundancy_overhead_lazy``); the eager
   coverage (forwards run / skipped per worker, seconds) from ``Result.redundant_forwards``. The layers
   are SLEEP-EMULATED Linear(H, H) layers: each holds a real H x H weight and bias (so the
   gradient message, the optimizer and the replica's duplicate optimizer step are real costs of
   real sizes) but sleeps instead of multiplying: forward and backward sleep the time the real
   ``nn.Linear`` forward / backward took on this machine at the same micro-batch (calibrated at
   start, 1 thread), so compute and parameters keep a real layer's proportion while the worker
   processes overlap on 2 cores as they would on their own devices. The weight gradient a
   backward returns is a fixed tensor of the weight's size (accumulated by autograd as a real one
   would be); eager forwards sleep the same forward time (a device's idle slot, no CPU). Default 2 stages (one process per core: the replica's extra CPU work does not
   compete with another stage for a core); ``--stages 4`` runs 4 processes on 2 cores.
   Replica bytes: ``StageReplica.nbytes()`` after a step, in-process (``build_engine`` +
   ``LocalDriver``), checked against the successor's parameters + buffers + optimizer state;
   extra bytes per step: the replica message's tensors (gradients + BatchNorm statistics +
   buffers) per worker, summed over the workers. Diagnostic: the replica's duplicate optimizer
   step (``StageReplica.apply``) timed in-process.
2. **Failover**: ``--failover-stages`` stages (4), one pipeline, a middle worker SIGKILLs itself
   (``FaultPlan``) at the start of a step: failover = end of the step before -> end of the redone
   step (target <= 1 s, key ``failover_s``); slowdown = step after / before (target <= 1.5x, key
   ``failover_slowdown``); every step once.
3. **Restart and checkpoint.** A redundant run with ``checkpoint_every`` (the ``checkpoint``
   reports' ``save_s`` when the run's events have them, and the pause the checkpoint leaves
   between two steps in metrics.jsonl), then ``virtualflow.train(..., resume=RUN_DIR)`` on fresh
   processes: restart = launch call -> end of the first resumed step, minus a normal step.
4. **Constants** for ``SpotConstants`` (``constants`` object, ``redundancy_overhead`` the eager one; ``constants_sources`` beside it
   names each constant's source, measured or default) and, when ``virtualflow.cluster.spot`` is
   importable, the simulator's replay of the shipped p2 trace with them (the simulator's output,
   not a measurement).

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bamboo            # about 8 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bamboo --quick    # under 2 minutes
"""

from __future__ import annotations

import os

# Before torch is imported anywhere in the package (the flat module did the same at its top).
os.environ.setdefault("OMP_NUM_THREADS", "1")
