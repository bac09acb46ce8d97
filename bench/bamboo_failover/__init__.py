"""Bamboo failover (issue 16): how long a single pipeline stops when it loses a worker, how much
slower it runs failed over, the pause when a replacement takes its stage back, a time-compressed
replay of a real spot trace against the simulator's prediction, and the spot simulator's value
on the shipped p2 trace with this engine's measured constants.

The job: ``--stages`` (3) stages, one pipeline (workers == stages), ``Pipeline(redundancy=True)``
(eager redundant forwards, the default ``redundant_compute="eager"``; section 1 runs every kill
with ``"lazy"`` too), 1F1B, ``--m`` (8) micro-batches, default (non-deterministic) mode, trained through
``virtualflow.launch`` on the local backend (one process per stage, 1 thread each). Each stage
is one SLEEP-EMULATED layer: a real ``--width`` x ``--width`` weight and bias (so the replica
refresh, the re-layout and the optimizer are real costs of real sizes) whose forward sleeps
``--f-ms`` and backward ``--b-ms`` per micro-batch (by default 12 / 24 ms: about four
``nn.Linear(1024, 1024)`` at micro-batch 256 on this machine, the stage that ``bench.bamboo``
calibrates), so that 3 processes overlap on 2 cores as on their own devices; the measured
full-depth step is checked against the schedule's nominal ``(m + p - 1) (f + b)``.

1. **Failover time** (key ``failover_s``, target <= 1 s): the benchmark SIGKILLs the middle
   stage's worker itself (``os.kill`` on its pid from ``handle.status()``, at a random point of a
   step), so the loss time is known exactly; failover = kill -> end of the first step completed
   after it (the interrupted step, redone on the failed-over layout). Split: kill -> ``failure``
   event (detection), ``failure`` -> ``formed`` of the failover generation (new group, re-layout:
   ``formed.pause_s``), ``formed`` -> end of the redone step. Median over all eager kills of
   (1)-(3). Each kill is repeated with ``redundant_compute="lazy"`` at the same point of the step
   (back to back, order alternated): failover and redone step eager vs lazy, and the eager
   forwards the redone step reused (``Result.redundant_forwards``).
2. **Failed-over slowdown** (key ``failover_slowdown``, target <= 1.5x, Bamboo's constant): in
   runs without replacement (``replace_failed=False``), median failed-over step (the redone step
   and the next left out) / median full-depth step before the kill (warm-up left out), same run.
   With p equal stages the worker running two of them does 2/p of the compute; 1F1B's nominal
   ratio is ``(2 m + 1) / (m + p - 1)`` for p = 3 (printed beside the measurement).
3. **Reconfiguration pause** (``replace_failed=True``): a replacement starts at the failover; when
   it is ready the pipeline re-forms at full depth at a step boundary (``reconfigure`` event).
   Pause = end of the first reconfigured step - end of the last failed-over step - a normal
   full-depth step. Also: the replacement's startup and where the pause goes.
4. **Time-compressed replay** (key ``replay_error``, target <= 0.10; lost steps must be 0): a
   window of the shipped ``p2-xlarge-2020-11-20-hours`` trace (``--replay-window-min``)
   compressed ``--replay-speedup`` times; each drop in the fleet's count SIGKILLs one of the
   pipeline's workers (stages in turn 1, 2, 0, ...), with ``replace_failed=True`` bringing a
   replacement back. A kill due while the pipeline is not yet back at full depth waits for it
   (two losses at once in a 3-stage pipeline are always adjacent stages: a fallback, not a
   failover) and is recorded as deferred. Measured throughput = samples of the steps completed
   in the replay window / its length. Prediction: ``predict(trace, constants, "bamboo",
   SpotJob(stages=p, pipelines=1))`` on the availability the job actually had (3 instances; 2
   from each kill to its replacement's ``ready`` event) with the constants measured in (1)-(3)
   of this run (``step_s`` = the full-depth step with redundancy, so ``redundancy_overhead`` 0;
   no checkpoints: none are taken in the replay), ``produced_between`` over the window.
5. **Constants and value**: ``bench/results/bamboo_constants.json`` = ``bench.bamboo``'s
   measured constants (``bench/results/bamboo.json`` as committed, else its working copy) with
   ``failover_s``, ``failover_slowdown`` and ``reconfigure_s`` from here, and ``sources`` naming
   each one's origin; then ``virtualflow simulate-spot --trace p2-xlarge-2020-11-20-hours
   --stages 4 --constants bench/results/bamboo_constants.json --json``: value vs on-demand (key
   ``value_vs_on_demand``, target >= 2) and vs checkpoint-restart (key ``value_vs_checkpoint``,
   target >= 1.5). The simulator's output, from partly mixed jobs (see the sources).

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bamboo_failover            # about 10 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bamboo_failover --quick    # about 2 minutes
"""

from __future__ import annotations

import os

# Before torch is imported anywhere in the package (the flat module did the same at its top).
os.environ.setdefault("OMP_NUM_THREADS", "1")
