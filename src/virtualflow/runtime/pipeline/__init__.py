"""The pipeline runtime: one worker's part of a pipelined job, run from a schedule's action list.

A :class:`StageEngine` holds the model pieces of one worker (stage-rank ``r`` of a pipeline
replica: pieces ``r, r + p, ...``) and runs a :class:`~virtualflow.plan.pipeline.Schedule`'s
action list for it, micro-batch ``i`` of step ``t`` being the ``i``-th virtual node this replica
runs. It never talks to the network itself: :meth:`StageEngine.steps` is a generator that
*yields* what it needs from outside (:class:`Send`, :class:`Recv`, :class:`StageSum`,
:class:`StageTree` (opened early by :class:`TreeOpen` and :class:`TreePart`), :class:`StageScatter`,
:class:`StageGather`, :class:`AllSum`) and gets the
answer back through ``send()``. Two drivers answer those requests:
:func:`virtualflow.runtime.pipeline.links.drive` in a worker process (torch.distributed point to
point and collectives over the generation's groups) and
:class:`virtualflow.runtime.pipeline.local.LocalDriver` (all workers of a job in one process,
cooperatively, for tests and for trying a pipeline without processes). So one piece of code runs
the schedule in both, and the in-process proofs hold for the multi-process runs.

Where each concept lives:

============== ===================================================================================
requests       what the engine yields to its driver (:class:`Send`, ..., :class:`AllSum`), and
               :class:`StepResult`
wire           message keys and the layout of every message (forward, backward, replica update)
schedule       :func:`schedule_for` (the runtime's one call site for building a schedule) and the
               schedule's bubbles (:func:`idle_slots`)
microbatch     a micro-batch's inputs (data or received message) and outputs (message or loss)
batchnorm      a piece's BatchNorm running statistics, kept exact across interleaved micro-batches
pieces         a worker's pieces as one module, its optimizer and update
loop           the training loop's knobs on a stage: autocast, loss scaling, clipping by the whole
               model's norm, checkpointing and compile per piece, the loss function's metrics
executor       the walk of one worker's action list (sans I/O)
flush          one step of a flush schedule: forward/backward, reduction, commit
stream         one window of a no-flush schedule (2BW, asynchronous PipeDream)
reduction      sums over the replicas: by stage group or job stage, and tied weights (default mode)
tied           deterministic mode: a weight read by two pieces, its uses summed per VN before the tree
tree_fold      deterministic mode: VNs folded into the tree as their backward ends, partials sent early
stage_shard    ``reduction="sharded"``: each stage's optimizer state sharded over its replicas
               (reduce-scatter, the chunk's update, the parameters' all-gather; gathers for the state)
timing         the step breakdown per stage: compute, p2p, bubble, reduction, update
redundancy     Bamboo: the replica of the successor's stage, eager forwards and their reuse
engine         :class:`StageEngine`, which composes the above
local          the in-process driver (:class:`LocalDriver`) and :func:`train_local`
links          the process driver: :func:`drive` over torch.distributed, the links' wire format, the
               deterministic exchange each stage group runs (:class:`~.links.StageExchanges`)
receive_wait   the process driver's receive waits, abortable by the generation's flag
stage_state    moving, gathering and resuming a stage's state between workers (Bamboo re-layouts),
               a checkpoint's per-stage states put together (or cut again for other stages)
tensor_grid    tensor parallelism's D x P x T grid: the planes, the layers' conversion, the shards'
               merge and cut
tensor_stage   :class:`~.tensor_stage.TensorStage`: a stage's tensor parallelism as one object (its
               groups, shards, the loop's hooks, the state merge; a trivial one without it)
layout         building a worker's stage engine: the job's layout or a Bamboo re-layout
settle         a step interrupted in its stats all-reduce, finished or discarded by the next generation
worker_engine  :class:`PipelineWorkerEngine`: the :class:`~virtualflow.runtime.engines.Engine` of a
               pipelined job in a worker process
============== ===================================================================================

What makes a pipelined step equal to the unpipelined one (``docs/pipeline.md``):

- **Micro-batch = virtual node.** A micro-batch loads the VN's samples (``plan.vn_indices``), its
  loss is weighted by ``n_v / B`` on the last piece, exactly as in the VN engine.
- **Random streams travel with the micro-batch.** The first piece seeds the stream with
  ``vn_seed(seed, step, vn)``; each piece sends the generator state after its forward along with
  its output, and the next piece continues from it. Dropout therefore draws the same numbers
  as in the unpipelined forward, whatever the schedule interleaves in between.
- **BatchNorm** running statistics of each piece are restored to the step's start before every
  micro-batch's forward and combined once per step (mean over the V virtual nodes, or VN 0's).
- **Gradients.** Default mode: backward accumulates into ``.grad`` (micro-batches in schedule
  order), then each piece's gradients are summed over the pipeline replicas (one group per
  stage-rank). Deterministic mode: each micro-batch's gradient vector (with BatchNorm statistics
  and, on the last piece, the weighted loss) is kept apart and summed along the fixed VN-id tree
  (:mod:`virtualflow.plan.vnmap`). Summation is element-wise, so a piece's slice of that sum is
  bit-identical to the same slice of the unpipelined job's sum, for every p, d, v and schedule.
- **Flush schedules** apply the update once per step after every piece's gradients are summed;
  a non-finite loss in any VN (learnt by every worker from one small all-reduce) skips the step.
- **No-flush schedules** (``2bw``, ``async``) stream ``window`` steps: a piece applies step ``t``'s
  update right after its last backward of step ``t``; forwards run on *snapshots* (weight
  versions, ``torch.func.functional_call``) so that the backward of a micro-batch uses the weights
  of its forward. ``2bw``: step ``t`` uses the weights after ``max(t - 1, 0)`` updates (two
  versions live); ``async``: the newest weights when the forward runs (weight stashing).

Message keys are ``(direction, from_piece, micro-batch)``; the process driver turns them into
gloo tags. A send never blocks; a receive blocks until its message is there (the schedule checker
proves no deadlock under exactly these rules).
"""

from __future__ import annotations

from virtualflow.runtime.pipeline.batchnorm import PieceBatchNorm
from virtualflow.runtime.pipeline.engine import StageEngine
from virtualflow.runtime.pipeline.executor import LOOKAHEAD, SLACK, run_actions
from virtualflow.runtime.pipeline.microbatch import MicroBatch, MicroBatchPrep
from virtualflow.runtime.pipeline.pieces import NoOptimizer
from virtualflow.runtime.pipeline.redundancy import Eager, Reuse, StageReplica
from virtualflow.runtime.pipeline.requests import (
    AllSum, Expect, Poll, Recv, Request, Send, StageGather, StageScatter, StageSum, StageTree, StepResult, TreeOpen,
    TreePart,
)
from virtualflow.runtime.pipeline.schedule import idle_slots, schedule_for
from virtualflow.runtime.pipeline.wire import MsgKey

# The names before the package split (the unit tests import them from here).
_Eager = Eager
_Reuse = Reuse

__all__ = [
    "AllSum", "Eager", "Expect", "LOOKAHEAD", "MicroBatch", "MicroBatchPrep", "MsgKey", "NoOptimizer",
    "PieceBatchNorm", "Poll", "Recv", "Request", "Reuse", "SLACK", "Send", "StageEngine", "StageGather",
    "StageReplica", "StageScatter", "StageSum", "StageTree", "StepResult", "TreeOpen", "TreePart", "idle_slots",
    "run_actions", "schedule_for",
]
