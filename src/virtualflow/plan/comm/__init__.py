"""Communication programs (CoCoNeT): computation and communication as one program. Pure code, no
processes.

- ``ir``: layouts (``Local``, ``Replicated``, ``Sliced(dim)``), ops, the validated ``Program``,
  layout inference and its errors.
- ``build``: the ``Builder`` (a program in a few lines of Python).
- ``rewrites``: ``split``, ``reorder``, ``fuse``, ``overlap``, ``boundary`` (Program -> Program), and
  ``overlap_reference`` (what an overlapped program equals bit for bit on every CPU).
- ``simulate``: a single-process p-rank interpreter with a per-rank byte ledger (ring formulas),
  the same ledger from shapes alone, and the memory each rank holds.
- ``kernels``: the local ops shared with the executor (``virtualflow.comm.program``), the ring's
  summation order and traffic.
- ``workloads``: the data-parallel Adam step, the Megatron MLP, the pipeline boundary.
- ``explain``: a program and its rewritten form with layouts and byte ledgers, as text.
"""

from __future__ import annotations

from virtualflow.plan.comm.build import Builder, Value
from virtualflow.plan.comm.ir import Decl, Info, Layout, Local, Op, Program, Replicated, Sliced
from virtualflow.plan.comm.rewrites import (
    REWRITES, apply, boundary, fuse, overlap, overlap_reference, reorder, split,
)
from virtualflow.plan.comm.simulate import CommRecord, SimResult, comm_ledger, memory_ledger, simulate
from virtualflow.plan.comm.workloads import WORKLOADS, dp_adam, example_inputs, pipeline_boundary, tp_mlp

__all__ = [
    "Builder", "Value", "Decl", "Info", "Layout", "Local", "Op", "Program", "Replicated", "Sliced", "REWRITES",
    "apply", "boundary", "fuse", "overlap", "overlap_reference", "reorder", "split", "CommRecord", "SimResult", "comm_ledger",
    "memory_ledger", "simulate", "WORKLOADS", "dp_adam", "example_inputs", "pipeline_boundary", "tp_mlp",
]
