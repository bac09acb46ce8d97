"""Pipeline parallelism: virtualflow's pipeline executor against ``torch.distributed.pipelining``,
its bubbles against the simulator, its stashed activations against the schedules' bounds, and its
deterministic mode against its default mode.

Four measurements in one run, from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline            # about 3 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline --quick    # about a minute
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline --deterministic-only [--quick]   # (4) alone

virtualflow runs as its executor, **not the worker loop**: ``backends.inprocess.build_engine`` (the
``StageEngine`` of a rank) driven by the public ``runtime.pipeline.worker_engine.drive`` over its own
``ProcessGroupGloo`` (``virtualflow.comm.groups.make_group``), with one ``Links`` per engine kept
across steps, as ``PipelineWorkerEngine`` keeps one per generation: from the second step on, every
receive's payload is posted before the message arrives (the engine announces its receives with
``Expect``). The optimizer step and the per-step all-reduce are inside ``StageEngine.steps``.

**(1) Step time against torch.distributed.pipelining** (real compute, p = 2). Two fresh processes
(``python -m bench.pipeline --child-vs JSON``, 1 thread each) on a TCPStore the launcher hosts on a
free port. torch: ``init_process_group("gloo")``, one ``PipelineStage`` per model piece of the rank,
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (2 pieces per rank) with
``loss_fn=cross_entropy``, then ``optimizer.step()`` and ``zero_grad()``. Same ``nn.Sequential``
(an MLP of 8 layers), same pieces (``resolve_bounds`` + ``piece_module``), same initial weights,
same micro-batches (virtualflow's ``DataPlan``: micro-batch i is virtual node i; torch gets their
concatenation and splits it into m chunks), SGD + momentum; the final weights agree (key
``weight_diff``). The two alternate step by step in the same 2 processes (order swapped every
step; an untimed barrier before each step), so host noise cancels; a step's time is the slower
rank's. Per schedule and repetition (fresh processes): median over post-warm-up steps; ratio =
virtualflow / torch, the median of the repetitions' ratios. Target <= 1.00 per schedule (keys
``ratio_gpipe``, ``ratio_1f1b``, ``ratio_interleaved_1f1b``).

The virtualflow side runs over a duplex group, as a pipelined job's workers build it: two gloo
devices on the same address (two TCP connections per pair of ranks; the driver's tag parity puts
each direction of a link on its own). Diagnostic third side (``--two-devices``, on by default; the
name is historical): the same executor over a group with one gloo device (both directions on one
connection), alternating with the other two. ``--skip-emulated`` runs part (1) alone.

A second model size (``--hidden2``, 1024 by default: about 4x the compute per message, 1 repetition)
is compared the same way as a diagnostic, not a target. Diagnostic, in the same processes after
the timed steps: a few more alternating steps with the
executor's timeline switched on (``StageEngine.timeline``): per rank, the step's time in compute
(F/B actions), blocked in receives, in sends, and the rest (the engine's bookkeeping between
actions, posting receives, the optimizer, the per-step all-reduce); and the latency of a message
whose receiver was already waiting (receive end - send end).

**(2) Bubbles with emulated compute** (p = 4, m = 8, equal stage times). Four processes, each a
``StageEngine`` (``Pipeline(record_timeline=True)``) driven by ``drive``. The model's layers
*sleep*: forward ``f``; backward through custom autograd Functions that sleep ``i`` on the
input-gradient path and ``w`` on the weight-gradient path (so ``B`` = i + w, zb_h1's ``I`` = i and
``W`` = w), so 4 processes overlap on 2 cores. Bubble of a rank in a step = 1 - (its compute
time) / (first compute start to last compute end of the step over all ranks), from the timeline,
averaged over ranks, median over steps (2BW: windows of steps). Against
``virtualflow.plan.pipeline.simulate`` with the nominal times, and for 1F1B also the analytic
``(p-1)/(m+p-1)``: within 5 points (key ``bubble_error``); interleaved and zb_h1 below 1F1B;
2BW throughput (samples/s over a window of steps) above 1F1B's (key ``throughput_2bw``).
``--f-ms/--i-ms/--w-ms`` change the emulated unit (10 ms each by default).

**(3) Stashed activations** (the same emulated runs): live micro-batch contexts per rank, counted
with ``torch.autograd.graph.saved_tensors_hooks``: a context (one forward of one piece, tagged by
a forward pre-hook on the piece) is live from its forward until the last tensor its graph saved
is released, i.e. after its last backward part. Peak per rank == the schedule's ``stash_bound``;
2BW: weight versions used by live contexts == 2.

**(4) Deterministic vs default pipelined step** (real compute, 1F1B, p = 2, d = 2: four processes):
``bench/pipeline/deterministic.py`` says how; target deterministic / default <= 1.10 (key
``ratio_deterministic``), and the two replicas' weights bit-identical.
"""

from __future__ import annotations

import os

# Before torch is imported anywhere in the package (the flat module did the same at its top).
os.environ.setdefault("OMP_NUM_THREADS", "1")
