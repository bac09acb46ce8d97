"""CoCoNeT (issue 15): our ring reduce-scatter against gloo's, and the sharded data-parallel step
against all-reduce + full Adam.

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.coconet            # about 6-9 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.coconet --quick    # about 2 minutes

**(1) Collectives** (2 ranks, float32, 10 M / 30 M / 100 M elements, even chunks). Two fresh
processes (``python -m bench.coconet --child-collectives JSON``, 1 thread each) build a gloo group
with ``virtualflow.comm.groups.make_group`` on a TCPStore the launcher hosts on a free port.
Methods, interleaved repetition by repetition (order rotated), each preceded by a small untimed
all-reduce as a barrier; a repetition's time is the slower rank's; median over repetitions after
the warm-up ones:

* ``ring``: :class:`virtualflow.comm.ring.Collectives` ``reduce_scatter`` (in place, synchronous);
* ``gloo_reduce_scatter``: gloo's own ``ProcessGroup.reduce_scatter`` (what
  ``torch.distributed.reduce_scatter`` calls; list of chunk views in, one chunk out);
* ``gloo_reduce_scatter_base``: gloo's ``_reduce_scatter_base`` (``reduce_scatter_tensor``);
* ``gloo_all_reduce``: gloo's all-reduce of the whole vector (the cost of doing it the old way).

Target (issue): ring >= 1.8x faster than gloo's reduce-scatter (key ``rs_speedup``; the faster of
gloo's two reduce-scatter entry points). All-gather likewise (``ring_ag`` vs ``gloo_allgather``
and ``gloo_allgather_base``), reported without a target. The ring's ledger bytes are checked
against the closed form (N - N/p) * 4 per rank.

**(2) Sharded data-parallel step** (2 processes, an MLP of 25 M parameters, Adam): the sharded
step (reduce-scatter -> Adam on the local slice -> all-gather) against all-reduce + full Adam.
Targets: step time ratio sharded / all-reduce <= 1.00 (key ``step_ratio``), optimizer-state tensor
bytes ÷ p (key ``opt_bytes_ratio``: full / sharded >= 0.99 p), and the peak RSS saving at least
80 % of the optimizer bytes saved (key ``rss_saving_fraction``). Measured through
``virtualflow.train(..., reduction="sharded")`` against the default ``reduction="allreduce"`` when the
installed virtualflow has that option (step times from ``Result.history``, peak RSS from
``Result.peak_rss_mib``); without it, through a plain-torch emulation in two processes (flat
gradient and parameter buffers; gloo all-reduce + ``torch.optim.Adam`` on every parameter, against
ring reduce-scatter + Adam on the local slice + ring all-gather), said so in the output. The
emulation runs in either case, beside torch's own ``ZeroRedundancyOptimizer`` (DDP + ZeRO-1) and
FSDP2 (``fully_shard`` per Linear + root) on gloo, same model, data and Adam, for reference (no
target); a variant that fails on gloo records its error.

2 cores: each of the 2 processes has 1 thread; ratios are at equal worker counts.
"""

from __future__ import annotations

import os

# Before torch is imported anywhere in the package (the flat module did the same at its top).
os.environ.setdefault("OMP_NUM_THREADS", "1")
