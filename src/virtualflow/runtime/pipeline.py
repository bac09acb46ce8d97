"""The pipeline executor: runs one worker's action list of a pipeline schedule.

A :class:`StageEngine` holds the model pieces of one worker (stage-rank ``r`` of a pipeline
replica: pieces ``r, r + p, ...``) and runs a :class:`~virtualflow.plan.pipeline.Schedule`'s
action list for it, micro-batch ``i`` of step ``t`` being the ``i``-th virtual node this replica
runs. It never talks to the network itself: :meth:`StageEngine.steps` is a generator that
*yields* what it needs from outside (:class:`Send`, :class:`Recv`, :class:`StageSum`,
:class:`StageTree`, :class:`AllSum`) and gets the answer back through ``send()``. Two drivers
answer those requests: :func:`virtualflow.runtime.pipeline_worker.drive` in a worker process
(torch.distributed point to point and collectives over the generation's groups) and
:class:`virtualflow.runtime.pipeline_local.LocalDriver` (all workers of a job in one process,
cooperatively, for tests and for trying a pipeline without processes). So one piece
of code runs the schedule in both, and the in-process proofs hold for the multi-process runs.

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

import bisect
import functools
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence

import torch
from torch import nn

from virtualflow.comm.reduce import tree_reduce_local
from virtualflow.pipeline import Pipeline, tensors_of
from virtualflow.plan.data import DataPlan, vn_seed
from virtualflow.plan.pipeline import SCHEDULES, Schedule
from virtualflow.plan.vnmap import Node, TreePlan
from virtualflow.runtime.engine import check_loss, seed_random_streams, to_device

MsgKey = tuple[str, int, int]  # ("F" | "B", from piece, micro-batch id within the action list)


# ---- requests a StageEngine yields to its driver ---------------------------------------------
@dataclass(slots=True)
class Send:
    peer: int
    """Stage-rank of the receiver in the same pipeline replica."""
    key: MsgKey
    tensors: list[torch.Tensor]


@dataclass(slots=True)
class Recv:
    peer: int
    key: MsgKey


@dataclass(slots=True)
class Expect:
    """A hint, no answer expected: ``Recv(peer, key)`` will come soon. A process driver posts
    the receive now, so the message moves as soon as it is sent instead of when it is needed."""

    peer: int
    key: MsgKey


@dataclass(slots=True)
class Poll:
    """Has the message ``Recv(peer, key)`` would take arrived? Answer ``True``/``False``, never
    blocks (eager redundant forwards run while the answer is ``False``)."""

    peer: int
    key: MsgKey


@dataclass(slots=True)
class StageSum:
    """Sum ``vector`` over the pipeline replicas of this stage-rank (default mode)."""

    vector: torch.Tensor
    stage: int | None = None
    """A job stage (a worker running several after a Bamboo failover): sum over the workers that
    run that stage in every replica; ``None``: this worker's one stage group."""


@dataclass(slots=True)
class StageTree:
    """Sum the per-VN tree nodes over the replicas of this stage-rank; the root comes back."""

    plan: TreePlan
    nodes: dict[Node, torch.Tensor]
    like: torch.Tensor
    stage: int | None = None
    """As :attr:`StageSum.stage`."""


@dataclass(slots=True)
class AllSum:
    """Sum ``vector`` over every worker of the job."""

    vector: torch.Tensor


Request = Send | Recv | Expect | Poll | StageSum | StageTree | AllSum

LOOKAHEAD = 4
SLACK = 1.1
"""An eager redundant forward starts in a bubble if it ends within this factor of the bubble's
predicted length (the prediction leaves out message latency, so waits run a little longer)."""
"""Receives announced (:class:`Expect`) ahead of the action that needs them, per worker."""


@dataclass(slots=True)
class StepResult:
    step: int
    loss: float
    bad_vns: list[int]
    control: int
    compute_s: float


@dataclass(slots=True)
class _MB:
    """What one (piece, micro-batch) holds between its forward and its backward."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: tuple[torch.Tensor, ...] = ()
    rng: torch.Tensor | None = None
    batch: Any = None
    n: int = 0
    version: dict[str, torch.Tensor] | None = None
    out_grads: list[torch.Tensor | None] | None = None
    in_grads: list[torch.Tensor] | None = None


@dataclass(slots=True)
class _Eager:
    """One eager redundant forward: the successor stage's forward of one micro-batch, run on this
    worker's replica, kept (graph included) until the step commits."""

    inputs: list[torch.Tensor]
    """The forward's input leaves (the message's tensors; empty for the first stage: its data)."""
    outputs: tuple[torch.Tensor, ...]
    single: bool
    """The stage returned one tensor (not a tuple)."""
    rng: Any
    """The random generator state(s) after the forward."""
    buffers: dict[str, torch.Tensor]
    """The replica's buffers after the forward (BatchNorm statistics), by whole-model name."""
    params: dict[str, torch.Tensor]
    """The replica's parameters the graph uses, by whole-model name."""


@dataclass
class _Reuse:
    """A failed-over worker's eager forwards of the stage it took over (layers ``[lo, hi)`` of the
    whole model), for the redone step: (step, VN) -> forward."""

    lo: int
    hi: int
    entries: dict[tuple[int, int], _Eager]


class _Splice(torch.autograd.Function):
    """Put an eager forward's outputs in place of running layers ``[lo, hi)`` again: forward gives
    the kept outputs; backward runs the kept graph, adds its parameter gradients to the layers that
    run the stage now (``targets``: whole-model name -> parameter) and hands the input gradients to
    the live graph below. The values are those of running the layers again (same weights, same
    inputs, same random stream), so the step is unchanged."""

    @staticmethod
    def forward(ctx, entry: _Eager, targets: dict[str, torch.Tensor], anchor: torch.Tensor, *live: torch.Tensor):
        ctx.entry, ctx.targets = entry, targets
        outs = tuple(o.detach().clone() for o in entry.outputs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        entry, targets = ctx.entry, ctx.targets
        outs, gs = [], []
        for o, g in zip(entry.outputs, grads):
            if o.is_floating_point() and o.requires_grad and g is not None:
                outs.append(o)
                gs.append(g)
        ins = [t for t in entry.inputs if t.requires_grad]
        names = [n for n, q in entry.params.items() if q.requires_grad]
        wrt = ins + [entry.params[n] for n in names]
        got = (torch.autograd.grad(outs, wrt, gs, allow_unused=True) if outs and wrt
               else (None,) * len(wrt))
        for n, g in zip(names, got[len(ins):]):
            if g is not None:
                q = targets[n]
                q.grad = g if q.grad is None else q.grad + g
        it = iter(got[:len(ins)])
        in_grads = [next(it) if t.requires_grad else None for t in entry.inputs]
        ctx.entry = ctx.targets = None
        return (None, None, None, *in_grads)


@functools.lru_cache(maxsize=64)
def idle_slots(name: str, p: int, m: int, b_over_f: float) -> tuple[tuple[float, ...], ...]:
    """Per stage-rank: for each action of a one-step schedule, the time a receive waits for its
    message (0 for other actions), then one more entry: the time from the rank's last action to
    the end of the step (when the slowest rank is done) - in forward times, every stage's forward
    taking 1 and its backward ``b_over_f`` (:func:`virtualflow.plan.pipeline.simulate.simulate`).
    These are the schedule's bubbles, where eager redundant forwards go."""
    from virtualflow.plan.pipeline.simulate import simulate

    sim = simulate(_schedule(name, p, m, 1, 1), 1.0, b_over_f)
    return tuple(tuple(float(sl.end - sl.start) if sl.action.kind in ("RECV_F", "RECV_B") else 0.0 for sl in rank)
                 + (float(sim.step_time - (rank[-1].end if rank else 0)),) for rank in sim.timeline)


def schedule_for(pipeline: Pipeline, m: int, steps: int = 1) -> Schedule:
    """The schedule of ``pipeline`` for ``m`` micro-batches (and ``steps`` streamed steps)."""
    return _schedule(pipeline.schedule, pipeline.stages, m, pipeline.chunks, steps)


@functools.lru_cache(maxsize=64)
def _schedule(name: str, p: int, m: int, v: int, steps: int) -> Schedule:
    """Schedules are pure and immutable: built once per shape, not once per step."""
    gen = SCHEDULES[name]
    if name == "interleaved_1f1b":
        return gen(p, m, v)
    if name in ("2bw", "async"):
        return gen(p, m, steps)
    return gen(p, m)


class StageEngine:
    """One worker of a pipeline replica: its model pieces, optimizer and schedule execution."""

    def __init__(
        self,
        *,
        pieces: dict[int, nn.Module],
        n_pieces: int,
        stage_rank: int,
        optimizer_factory: Callable[[Any], torch.optim.Optimizer],
        scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None,
        pipeline: Pipeline,
        plan: DataPlan,
        loader: Callable[[torch.Tensor], Any],
        model_input: Callable[[Any], Any],
        output_loss: Callable[[Any, Any], torch.Tensor],
        seed: int,
        batchnorm: str,
        deterministic: bool,
        device: torch.device,
        tied: Sequence[tuple[torch.nn.Parameter | None, int, torch.dtype]] = (),
        successor_pieces: dict[int, nn.Module] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.tied = list(tied)
        """Weights shared with pieces on other workers: per shared weight, this worker's copy (or
        None), its size and dtype, in the same order on every worker (``pipeline.tied_parameters``).
        Their gradients are summed over the copies before every update."""
        if self.tied and (deterministic or not pipeline.flush):
            raise ValueError("weights shared across pipeline workers need default mode and a flush schedule")
        self.p = pipeline.stages
        self.stage_rank = stage_rank
        self.n_pieces = n_pieces
        self.pieces = dict(sorted(pieces.items()))
        # One module holding this worker's layers under their whole-model names, so its
        # state_dict is this worker's slice of the whole model's state_dict.
        self.model = nn.Sequential(OrderedDict(
            (name, layer) for k in self.pieces for name, layer in self.pieces[k].named_children()
        ))
        self.params = [q for q in self.model.parameters() if q.requires_grad]
        self.piece_params = {k: [q for q in m.parameters() if q.requires_grad] for k, m in self.pieces.items()}
        # A worker whose pieces have no parameters (a stage of activations only) has no optimizer.
        self.optimizer = optimizer_factory(self.model.parameters()) if self.params else _NoOptimizer()
        self.scheduler = (scheduler_factory(self.optimizer) if scheduler_factory is not None and self.params
                          else None)
        self.plan = plan
        self.loader = loader
        self.model_input = model_input
        self.output_loss = output_loss
        self.seed = seed
        self.batchnorm = batchnorm
        self.deterministic = deterministic
        self.device = device
        self.bn = {k: _PieceBatchNorm(m) for k, m in self.pieces.items()}
        self.bn_numel = sum(b.numel for b in self.bn.values())
        self.grad_numel = sum(q.numel() for q in self.params)
        self.replicas = 1
        self.replica = 0
        self.job_stages: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None
        """Bamboo, several replicas, this worker running several job stages: per job stage, the
        indices of its gradients and of its BatchNorm statistics in this worker's flat vectors
        (:meth:`set_job_stages`); each job stage is reduced over its own workers."""
        self.assignment: list[list[int]] = [list(range(plan.virtual_nodes))]
        self.tree: TreePlan | None = None
        self.timeline: list[dict[str, Any]] | None = [] if pipeline.record_timeline else None
        self.phase = "idle"
        self.slowdown = 1.0
        self.pending_commit: tuple[int, Callable[[torch.Tensor], StepResult]] | None = None
        """(step, finish) while the step's stats all-reduce runs (flush schedules): what the step
        still does once the stats are known (the gradients are reduced by then)."""
        self.last_commit: tuple[int, torch.Tensor] | None = None
        """(step, stats) of the last step whose stats all-reduce completed here."""
        self.prev_version: dict[int, dict[str, torch.Tensor]] | None = None
        """``2bw``: per piece, the weights after the second-to-last update (the version the next
        window's first step runs on); ``None`` before the first update."""
        self._clone_input = {k: any(getattr(mod, "inplace", False) for mod in next(iter(m.children()), nn.Identity()).modules())
                             for k, m in self.pieces.items()}
        self.fault_point: Callable[[str], None] | None = None
        """Fault injection (tests): called with a phase name at the points of
        :mod:`virtualflow.runtime.faults` a step passes (first send, first backward, the commit's
        reduction, the update)."""
        self.replica_of_successor: StageReplica | None = None
        """``Pipeline.redundancy``: the successor's stage, kept up to date after every step."""
        if successor_pieces is not None:
            if self.tied:
                raise ValueError("Pipeline.redundancy=True does not support weights shared across pipeline workers yet")
            self.replica_of_successor = StageReplica(successor_pieces, optimizer_factory, scheduler_factory,
                                                     (stage_rank + 1) % self.p)
        self.eager = pipeline.eager_forwards and self.replica_of_successor is not None
        """``Pipeline.redundant_compute="eager"``: run the successor's forwards on the replica in
        idle slots (:meth:`_eager_forward`)."""
        self.reuse: _Reuse | None = None
        """After a failover: the eager forwards of the stage this worker took over, used by the
        redone step instead of running that stage's forwards again."""
        self.reused_forwards = 0
        """Forwards the redone step took from eager forwards (since this engine was built)."""
        self.eager_every_wait = os.environ.get("VIRTUALFLOW_EAGER_EVERY_WAIT") == "1"
        """Diagnostic (``VIRTUALFLOW_EAGER_EVERY_WAIT=1``): run eager forwards at every receive whose
        message is not there yet, bubble or not, from the first step (tests use it to make the
        failover's reuse certain; it shows what placing them in the bubbles saves)."""
        self.fb_times: tuple[float, float] | None = None
        """This worker's mean forward and backward seconds per micro-batch in its last step (they
        place eager forwards in the schedule's bubbles)."""
        if not pipeline.flush and self.bn_numel:
            raise ValueError(
                f"Pipeline.schedule={pipeline.schedule!r} streams steps without a flush, which cannot keep "
                f"BatchNorm's per-step statistics exact; use a flush schedule (1f1b, gpipe, interleaved_1f1b, "
                f"zb_h1) for a model with BatchNorm"
            )

    # ---- membership -----------------------------------------------------------------------
    def set_layout(self, replica: int, assignment: Sequence[Sequence[int]]) -> None:
        """Adopt a generation: this worker is in pipeline replica ``replica``; ``assignment[j]`` are
        the VNs replica ``j`` runs (in micro-batch order)."""
        self.replica = replica
        self.replicas = len(assignment)
        self.assignment = [list(a) for a in assignment]
        self.tree = TreePlan.build(self.assignment) if self.deterministic else None
        vns = self.assignment[replica]
        if not vns:
            raise ValueError(
                f"pipeline replica {replica} has no virtual node; every replica needs at least one: use at most "
                f"{self.plan.virtual_nodes} replicas"
            )
        schedule_for(self.pipeline, len(vns), self.pipeline.window)  # validate m for this schedule now

    def set_job_stages(self, stages: Sequence[tuple[int, int, int]] | None) -> None:
        """Bamboo: this worker runs the job stages ``(stage, first layer, end layer)`` (consecutive,
        in order) of a failed-over replica while other replicas run them on one worker each. Its
        reductions over the replicas then go job stage by job stage, each over the workers that
        run that stage (:attr:`StageSum.stage`), so every element is summed over the same replicas
        in the same order as in an undisturbed run. ``None``: one reduction (one stage group)."""
        if stages is None:
            self.job_stages = None
            return

        def stage_of(layer: int) -> int:
            for s, a, b in stages:
                if a <= layer < b:
                    return s
            raise ValueError(f"layer {layer} of this worker is in none of its job stages {list(stages)}")

        grad_owner = []
        for name, q in self.model.named_parameters():
            if q.requires_grad:
                grad_owner += [stage_of(int(name.split(".")[0]))] * q.numel()
        bn_owner = []
        for k, module in self.pieces.items():  # the flat layout of _PieceBatchNorm, layer by layer
            for name, layer in module.named_children():
                n = sum(m.running_mean.numel() + m.running_var.numel() for m in layer.modules()
                        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats)
                bn_owner += [stage_of(int(name))] * n
        if len(bn_owner) != self.bn_numel:
            raise RuntimeError("BatchNorm statistics of a shared module cannot be split by job stage")
        g, b = torch.tensor(grad_owner, dtype=torch.int64), torch.tensor(bn_owner, dtype=torch.int64)
        self.job_stages = [(s, torch.nonzero(g == s).reshape(-1), torch.nonzero(b == s).reshape(-1))
                           for s, _, _ in stages]

    def _stage_slices(self, grads: bool, bn: bool, loss: bool) -> list[tuple[int, torch.Tensor]]:
        """Per job stage, the indices of its elements in a vector laid out [grads | BatchNorm
        statistics | loss] (each part present as told); the loss goes with the last job stage."""
        G = self.grad_numel if grads else 0
        B = self.bn_numel if bn else 0
        out = []
        for i, (s, gi, bi) in enumerate(self.job_stages):
            parts = ([gi] if grads else []) + ([bi + G] if bn else [])
            if loss and i == len(self.job_stages) - 1:
                parts.append(torch.tensor([G + B], dtype=torch.int64))
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            out.append((s, idx.to(self.device)))
        return out

    def _sum_by_stage(self, vec: torch.Tensor, grads: bool, bn: bool, loss: bool) -> Generator[Request, Any, torch.Tensor]:
        """:class:`StageSum` of ``vec``, job stage by job stage (see :meth:`set_job_stages`)."""
        if self.job_stages is None:
            return (yield StageSum(vec))
        out = torch.empty_like(vec)
        for s, idx in self._stage_slices(grads, bn, loss):
            part = yield StageSum(vec.index_select(0, idx), stage=s)
            out.index_copy_(0, idx, part)
        return out

    def _tree_by_stage(self, nodes: dict[Node, torch.Tensor], like: torch.Tensor, bn: bool,
                       loss: bool) -> Generator[Request, Any, torch.Tensor]:
        """:class:`StageTree` of ``nodes``, job stage by job stage (see :meth:`set_job_stages`):
        the tree's sums are element-wise, so each element's sum is the undisturbed run's."""
        if self.job_stages is None:
            return (yield StageTree(self.tree, nodes, like))
        out = torch.empty_like(like)
        for s, idx in self._stage_slices(True, bn, loss):
            sub = {node: t.index_select(0, idx) for node, t in nodes.items()}
            part = yield StageTree(self.tree, sub, like.index_select(0, idx), stage=s)
            out.index_copy_(0, idx, part)
        return out

    @property
    def first(self) -> int:
        return 0

    @property
    def last(self) -> int:
        return self.n_pieces - 1

    # ---- one action list --------------------------------------------------------------------
    def steps(self, first_step: int, n_steps: int, control: int = 0) -> Generator[Request, Any, list[StepResult]]:
        """Run steps ``first_step .. first_step + n_steps - 1`` (flush schedules: one at a time;
        no-flush schedules: streamed as one action list). Yields requests; returns one
        :class:`StepResult` per step."""
        results = []
        if self.pipeline.flush:
            for t in range(first_step, first_step + n_steps):
                res = yield from self._flush_step(t, control if t == first_step else 0)
                results.append(res)
            return results
        return (yield from self._stream(first_step, n_steps, control))

    def _vn_of(self, first_step: int, mb: int, m: int) -> tuple[int, int]:
        """(step, VN id) of micro-batch ``mb`` of an action list starting at ``first_step``."""
        return first_step + mb // m, self.assignment[self.replica][mb % m]

    def _run_actions(self, schedule: Schedule, first_step: int, mbs: dict, *, on_backward_done=None,
                     forward=None, backward=None, eager: bool = False) -> Generator[Request, Any, float]:
        """Run this worker's actions; returns its compute seconds (eager redundant forwards, run
        while a receive would wait, not included)."""
        m = schedule.m
        local: dict[MsgKey, list[torch.Tensor]] = {}
        grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        busy = 0.0
        replica = self.replica_of_successor if eager else None
        todo: deque[tuple[int, int, list[torch.Tensor] | None]] = deque()  # eager forwards not run yet
        idle: Sequence[float] = ()
        f_s = 0.0
        if replica is not None and self.eager_every_wait:
            idle = [float("inf")] * (len(schedule.actions[self.stage_rank]) + 1)
        elif replica is not None and self.fb_times is not None:
            # Eager forwards go where the schedule has this worker wait (its bubbles), as long as
            # the predicted wait holds one more: they never delay a message that is due.
            f_s, b_s = self.fb_times
            units = idle_slots(self.pipeline.schedule, self.p, m, round(4 * b_s / f_s) / 4 if f_s > 0 else 2.0)
            idle = [u * f_s for u in units[self.stage_rank]]
        elif replica is not None:
            replica.skipped += m  # the first step: no measured times to find the bubbles with yet
            replica = None
        if replica is not None and self.first in replica.pieces:
            # The replica of the first stage: its inputs are the micro-batches' data, known now.
            todo.extend((*self._vn_of(first_step, mb, m), None) for mb in range(m))
        f_sum = b_sum = 0.0
        f_n = b_n = 0
        t_origin = time.perf_counter()
        wall_origin = time.time()
        actions = schedule.actions[self.stage_rank]
        receives = [k for k, a in enumerate(actions) if a.kind in ("RECV_F", "RECV_B")]
        announced = 0  # receives[:announced] have been announced
        sent = backed = False
        for index, a in enumerate(actions):
            done = bisect.bisect_left(receives, index)  # receives before this action have run
            while announced < min(len(receives), done + LOOKAHEAD):
                b = actions[receives[announced]]
                yield Expect(b.peer, _recv_key(b))
                announced += 1
            if todo and idle[index] > 0 and a.kind in ("RECV_F", "RECV_B"):
                # A bubble: run redundant forwards while the message is not there and the
                # predicted wait still holds one.
                key = _recv_key(a)
                t_slot = time.perf_counter()
                while todo and time.perf_counter() - t_slot + replica.forward_est(f_s) <= SLACK * idle[index] \
                        and not (yield Poll(a.peer, key)):
                    self._eager_forward(*todo.popleft())
            t0 = time.perf_counter()
            if a.kind == "RECV_F":
                tensors = yield Recv(a.peer, ("F", a.stage - 1, a.microbatch))
                local[("F", a.stage - 1, a.microbatch)] = tensors
            elif a.kind == "RECV_B":
                tensors = yield Recv(a.peer, ("B", a.stage + 1, a.microbatch))
                local[("B", a.stage + 1, a.microbatch)] = tensors
            elif a.kind == "SEND_F":
                ctx = mbs[a.stage, a.microbatch]
                if not sent and self.fault_point is not None:
                    sent = True
                    self.fault_point("send_recv")
                message = _forward_message(ctx)
                yield Send(a.peer, ("F", a.stage, a.microbatch), message)
                if replica is not None and a.stage + 1 in replica.pieces:
                    todo.append((*self._vn_of(first_step, a.microbatch, m), message))
            elif a.kind == "SEND_B":
                yield Send(a.peer, ("B", a.stage, a.microbatch), grads_out.pop((a.stage, a.microbatch)))
            elif a.kind == "F":
                step, vn = self._vn_of(first_step, a.microbatch, m)
                if a.stage == self.first:
                    message = None
                else:
                    message = local.pop(("F", a.stage - 1, a.microbatch))
                    if self.pieces.get(a.stage - 1) is not None:  # the previous piece is local
                        message = [t.detach() for t in message]
                mbs[a.stage, a.microbatch] = forward(a.stage, a.microbatch, step, vn, message)
                if a.stage + 1 in self.pieces:  # pass to the next piece on this worker
                    local[("F", a.stage, a.microbatch)] = _forward_message(mbs[a.stage, a.microbatch])
            else:  # B, I, W
                if not backed and self.fault_point is not None:
                    backed = True
                    self.fault_point("mid_backward")
                ctx = mbs[a.stage, a.microbatch]
                if a.kind in ("B", "I") and a.stage != self.last:
                    ctx.out_grads = local.pop(("B", a.stage + 1, a.microbatch))
                backward(a.kind, a.stage, a.microbatch, ctx)
                if a.kind in ("B", "I") and a.stage != self.first:
                    if a.stage - 1 in self.pieces:
                        local[("B", a.stage, a.microbatch)] = ctx.in_grads
                    else:
                        grads_out[a.stage, a.microbatch] = ctx.in_grads
                    ctx.in_grads = None
                if a.kind in ("B", "W"):
                    del mbs[a.stage, a.microbatch]
                    if on_backward_done is not None:
                        yield from on_backward_done(a.stage, a.microbatch, ctx)
                ctx = None  # a finished micro-batch's graph (and its weight version) may go now
            t1 = time.perf_counter()
            if a.kind in ("F", "B", "I", "W"):
                busy += t1 - t0
                if self.slowdown > 1.0:
                    time.sleep((self.slowdown - 1.0) * (t1 - t0))
                    t1 = time.perf_counter()
                if a.kind == "F":
                    f_sum, f_n = f_sum + t1 - t0, f_n + 1
                elif a.kind == "B":
                    b_sum, b_n = b_sum + t1 - t0, b_n + 1
            if self.timeline is not None:
                # wall-clock times, comparable between the workers of one machine
                self.timeline.append({"kind": a.kind, "stage": a.stage, "mb": a.microbatch,
                                      "step": first_step + a.microbatch // m,
                                      "start": wall_origin + (t0 - t_origin), "end": wall_origin + (t1 - t_origin)})
        if todo and 0 < idle[-1] < float("inf"):
            # The bubble between this worker's last action and the slowest worker's.
            t_slot = time.perf_counter()
            while todo and time.perf_counter() - t_slot + replica.forward_est(f_s) <= SLACK * idle[-1]:
                self._eager_forward(*todo.popleft())
        if replica is not None:
            replica.skipped += len(todo)  # no idle slot was left for them: a failover recomputes them
        if f_n and b_n:
            self.fb_times = (f_sum / f_n, b_sum / b_n)
        return busy

    def _eager_forward(self, step: int, vn: int, message: list[torch.Tensor] | None) -> None:
        """Bamboo's eager redundant computation: the successor stage's forward of micro-batch
        (step, VN) on the replica, from the message this worker sent it (or the VN's data for the
        first stage), kept with its graph until the step commits."""
        replica = self.replica_of_successor
        (k, module), = replica.pieces.items()
        t0 = time.perf_counter()
        bn = replica.bn[k]
        if bn:
            bn.restore()
        ctx = _MB()
        x = self._inputs(k, step, vn, message, ctx, clone=replica.clone_input)
        weights = {q.untyped_storage().data_ptr() for q in module.parameters()}
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:  # what the kept graph holds (weights aside)
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                kept[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(x)
        try:
            outs = tensors_of(out)
        except TypeError:  # a model output of another kind (the last stage's): not kept
            outs = None
        if outs is not None:
            rng = torch.get_rng_state()
            if self.device.type == "cuda":
                rng = (rng, torch.cuda.get_rng_state(self.device))
            replica.eager[step, vn] = _Eager(
                inputs=list(ctx.inputs), outputs=outs, single=isinstance(out, torch.Tensor), rng=rng,
                buffers={n: b.detach().clone() for n, b in module.named_buffers()},
                params=dict(module.named_parameters()))
            for t in outs:
                kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            replica.kept_bytes += sum(kept.values())
            replica.peak_kept_bytes = max(replica.peak_kept_bytes, replica.kept_bytes)
        t1 = time.perf_counter()
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (t1 - t0))
        dt = time.perf_counter() - t0
        replica.forward_s += dt
        replica.forwards += 1
        replica.last_forward_s = dt

    def _spliced_forward(self, module: nn.Module, x: Any, entry: _Eager) -> Any:
        """``module(x)`` with layers ``[reuse.lo, reuse.hi)`` taken from an eager forward."""
        lo, hi = self.reuse.lo, self.reuse.hi
        targets = dict(module.named_parameters())
        h = x
        for name, layer in module.named_children():
            i = int(name)
            if i < lo or i >= hi:
                h = layer(h)
            elif i == lo:
                live = tensors_of(h) if entry.inputs else ()
                anchor = torch.zeros((), device=self.device, requires_grad=True)
                outs = _Splice.apply(entry, targets, anchor, *live)
                h = outs[0] if entry.single else tuple(outs)
                with torch.no_grad():
                    for bname, value in entry.buffers.items():
                        owner, _, leaf = bname.rpartition(".")
                        setattr(module.get_submodule(owner) if owner else module, leaf, value.clone())
                if isinstance(entry.rng, tuple):
                    torch.set_rng_state(entry.rng[0])
                    torch.cuda.set_rng_state(entry.rng[1], self.device)
                else:
                    torch.set_rng_state(entry.rng)
                self.reused_forwards += 1
        return h

    # ---- forward and backward of one (piece, micro-batch) -------------------------------------
    def _inputs(self, k: int, step: int, vn: int, message: list[torch.Tensor] | None, ctx: _MB,
                clone: bool | None = None) -> Any:
        if message is None:  # the first piece: the VN's data, a fresh random stream
            indices = self.plan.vn_indices(step, vn)
            ctx.batch, ctx.n = to_device(self.loader(indices), self.device), len(indices)
            seed_random_streams(vn_seed(self.seed, step, vn), self.device)
            return self.model_input(ctx.batch)
        # The generator states may be views into a received buffer: the generators want their own.
        if self.device.type == "cuda":
            *tensors, rng, cuda_rng = message
            torch.cuda.set_rng_state(cuda_rng.cpu().clone(), self.device)
        else:
            *tensors, rng = message
        torch.set_rng_state(rng.cpu().clone())
        ins = []
        for t in tensors:
            t = t.detach()
            if t.is_floating_point():
                t.requires_grad_(True)
            ins.append(t)
        ctx.inputs = ins
        clone = self._clone_input[k] if clone is None else clone
        x = [t.clone() if clone and t.is_floating_point() else t for t in ins]
        return x[0] if len(x) == 1 else tuple(x)

    def _finish_forward(self, k: int, step: int, vn: int, out: Any, ctx: _MB) -> None:
        if k == self.last:
            if ctx.batch is None:
                indices = self.plan.vn_indices(step, vn)
                ctx.batch, ctx.n = to_device(self.loader(indices), self.device), len(indices)
            loss = self.output_loss(out, ctx.batch)
            check_loss(loss, f"Job.output_loss at step {step} in virtual node {vn}")
            ctx.outputs = (loss * (ctx.n / self.plan.global_batch_size),)
        else:
            ctx.outputs = tensors_of(out)
        if k != self.first:
            ctx.batch = None if k != self.last else ctx.batch
        ctx.rng = torch.get_rng_state()
        if self.device.type == "cuda":
            ctx.rng = (ctx.rng, torch.cuda.get_rng_state(self.device))

    def _grad_pairs(self, ctx: _MB) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(outputs that need a backward, their gradients)."""
        if ctx.out_grads is None:  # the last piece: the weighted loss
            return [ctx.outputs[0]], None
        outs, grads = [], []
        floats = [o for o in ctx.outputs if o.is_floating_point()]
        for o, g in zip(floats, ctx.out_grads):
            if o.requires_grad:
                outs.append(o)
                grads.append(g)
        return outs, grads

    def _input_grads(self, ctx: _MB, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        wanted = [t for t in ctx.inputs if t.is_floating_point()]
        return [g if g is not None else torch.zeros_like(t) for t, g in zip(wanted, grads)]

    # ---- flush schedules ----------------------------------------------------------------------
    def _flush_step(self, step: int, control: int) -> Generator[Request, Any, StepResult]:
        vns = self.assignment[self.replica]
        m = len(vns)
        schedule = schedule_for(self.pipeline, m)
        V = self.plan.virtual_nodes
        self.model.train()
        for bn in self.bn.values():
            if bn:
                bn.snapshot()
        if self.eager:
            self.replica_of_successor.begin_step()
        if self.reuse is not None and not any(key[0] == step for key in self.reuse.entries):
            self.reuse = None
        self.optimizer.zero_grad(set_to_none=True)
        bn_acc = {k: torch.zeros(b.numel, device=self.device) for k, b in self.bn.items()}
        bn_first: dict[int, torch.Tensor] = {}
        losses: dict[int, torch.Tensor] = {}
        leaves: dict[int, list[torch.Tensor]] = {}  # deterministic mode: VN -> parts per piece
        bn_vn: dict[tuple[int, int], torch.Tensor] = {}  # deterministic mode: (piece, VN) -> statistics
        mbs: dict[tuple[int, int], _MB] = {}

        def forward(k: int, mb: int, step_: int, vn: int, message) -> _MB:
            ctx = _MB()
            bn = self.bn[k]
            if bn:
                bn.restore()
            x = self._inputs(k, step_, vn, message, ctx)
            entry = self.reuse.entries.pop((step_, vn), None) if self.reuse is not None else None
            out = self._spliced_forward(self.pieces[k], x, entry) if entry is not None else self.pieces[k](x)
            self._finish_forward(k, step_, vn, out, ctx)
            if bn.numel:
                if self.deterministic and self.batchnorm == "mean":
                    bn_vn[k, vn] = bn.flat()
                elif self.batchnorm == "mean":
                    bn_acc[k] += bn.flat()
                elif vn == 0:
                    bn_first[k] = bn.flat()
            if k == self.last:
                losses[vn] = ctx.outputs[0].detach()
            return ctx

        def backward(kind: str, k: int, mb: int, ctx: _MB) -> None:
            outs, grads = self._grad_pairs(ctx)
            params = self.piece_params[k]
            wants_input = [t for t in ctx.inputs if t.is_floating_point()]
            if self.deterministic and kind in ("B", "W"):
                for q in params:
                    q.grad = None
            if kind == "B":
                if params or wants_input:
                    torch.autograd.backward(outs, grads, inputs=params + wants_input)
                if wants_input:
                    ctx.in_grads = self._input_grads(ctx, [t.grad for t in wants_input])
            elif kind == "I":
                if wants_input:
                    got = torch.autograd.grad(outs, wants_input, grads, retain_graph=True, allow_unused=True)
                    ctx.in_grads = self._input_grads(ctx, got)
            else:  # W
                if params:
                    torch.autograd.backward(outs, grads, inputs=params)
            if self.deterministic and kind in ("B", "W"):
                vn = vns[mb % m]
                parts = [q.grad.reshape(-1) if q.grad is not None else q.new_zeros(q.numel()) for q in params]
                for q in params:
                    q.grad = None
                leaves.setdefault(vn, []).append((k, parts))

        self.phase = "compute"
        compute_s = yield from self._run_actions(schedule, step, mbs, forward=forward, backward=backward,
                                                 eager=self.eager)
        self.reuse = None
        self.phase = "reduction"
        # Per-rank reduction vector: [grads of my params | my BatchNorm statistics | loss].
        is_last = self.last in self.pieces
        if self.deterministic:
            with_bn = self.bn_numel and self.batchnorm == "mean"

            def leaf(vn: int) -> torch.Tensor:
                by_piece = dict(leaves.pop(vn))
                parts = [x for k in self.pieces for x in by_piece[k]]
                if with_bn:
                    parts += [bn_vn.pop((k, vn)) for k in self.pieces if self.bn[k].numel]
                if is_last:
                    parts.append(losses[vn].reshape(1))
                return torch.cat(parts) if parts else torch.zeros(0, device=self.device)

            nodes = tree_reduce_local(self.tree.per_worker[self.replica], leaf)
            like = next(iter(nodes.values()))
            total = yield from self._tree_by_stage(nodes, like, bool(with_bn), is_last)
            offset = 0
            for q in self.params:
                q.grad = total[offset: offset + q.numel()].view_as(q).clone()
                offset += q.numel()
            bn_new = None
            if with_bn:
                bn_new = total[offset: offset + self.bn_numel] / V
                offset += self.bn_numel
            loss_total = total[offset] if is_last else None
        else:
            # [grads | BatchNorm statistics | loss], summed over the replicas in one vector; with
            # one replica nothing is summed and the gradients stay where backward put them.
            multi = self.replicas > 1
            parts = ([q.grad.reshape(-1) if q.grad is not None else q.new_zeros(q.numel()) for q in self.params]
                     if multi else [])
            if self.bn_numel:
                if self.batchnorm == "mean":
                    parts += [bn_acc[k] for k in self.pieces if self.bn[k].numel]
                else:
                    parts += [bn_first.get(k, torch.zeros(self.bn[k].numel, device=self.device))
                              for k in self.pieces if self.bn[k].numel]
            if is_last:
                parts.append(torch.stack([losses[v] for v in vns]).sum().reshape(1))
            vec = torch.cat(parts) if parts else torch.zeros(0, device=self.device)
            offset = 0
            if multi:
                vec = yield from self._sum_by_stage(vec, True, bool(self.bn_numel), is_last)
                for q in self.params:
                    q.grad = vec[offset: offset + q.numel()].view_as(q).clone()
                    offset += q.numel()
            bn_new = None
            if self.bn_numel:
                bn_new = vec[offset: offset + self.bn_numel]
                if self.batchnorm == "mean":
                    bn_new = bn_new / V
                offset += self.bn_numel
            loss_total = vec[offset] if is_last else None
        if self.tied:
            # A weight held by several workers: sum its copies' gradients (each replica's copies are
            # already summed over the replicas, so replica 0 alone contributes) and give every copy
            # the total, so all copies take the same update.
            parts = []
            for param, numel, dtype in self.tied:
                grad = param.grad if param is not None and self.replica == 0 else None
                parts.append(grad.reshape(-1) if grad is not None else torch.zeros(numel, dtype=dtype, device=self.device))
            total = yield AllSum(torch.cat(parts))
            offset = 0
            for param, numel, _ in self.tied:
                if param is not None:
                    param.grad = total[offset: offset + numel].view_as(param).clone()
                offset += numel
        replica_update = None
        if self.replica_of_successor is not None:
            # Bamboo: hand the predecessor what it needs to take this stage's step on its replica
            # (reduced gradients, BatchNorm statistics, buffers) before the step commits below, so
            # a replica is never behind a committed step.
            p_ = self.p
            grads = [q.grad.reshape(-1) if q.grad is not None else q.new_zeros(q.numel()) for q in self.params]
            message = [torch.cat(grads) if grads else torch.zeros(0, device=self.device),
                       bn_new if bn_new is not None else torch.zeros(0, device=self.device)]
            message += [b.detach() for b in self.model.buffers()]
            succ = self.replica_of_successor.stage_rank
            yield Expect(succ, ("R", succ, step))
            yield Send((self.stage_rank - 1) % p_, ("R", self.stage_rank, step), message)
            replica_update = yield Recv(succ, ("R", succ, step))
        # One small all-reduce: bad VNs, control, loss (from one last-stage worker), compute times.
        stats = torch.zeros(V + 2, dtype=torch.float64, device=self.device)
        if is_last:
            for v in vns:
                stats[v] = float(not torch.isfinite(losses[v]).item())
            if self.replica == 0:
                stats[V + 1] = float(loss_total)
        stats[V] = control
        if self.fault_point is not None:
            self.fault_point("during_reduction")
        first_bn = self.deterministic and self.bn_numel and self.batchnorm == "first"
        if first_bn:
            vec = torch.cat([bn_first.get(k, torch.zeros(self.bn[k].numel, device=self.device)) for k in self.pieces])
            if self.replicas == 1:
                bn_new, first_bn = vec, False

        def commit(stats: torch.Tensor, bn_new: torch.Tensor | None) -> StepResult:
            """The rest of the step once the stats all-reduce is through: skip it (a bad VN) or
            apply it. Kept as :attr:`pending_commit` while that all-reduce runs: a failure can
            complete it on some members only (they apply the step), and the others then finish
            the step from the stats those hand over (:meth:`finish_commit`)."""
            bad = [v for v in range(V) if stats[v] > 0]
            result = StepResult(step, float(stats[V + 1]), bad, int(round(float(stats[V]))), compute_s)
            if bad:
                for bn in self.bn.values():
                    if bn:
                        bn.restore()
                        bn.settle()
                if self.replica_of_successor is not None:
                    self.replica_of_successor.end_step(applied=False)
                self.optimizer.zero_grad(set_to_none=True)
                self.phase = "idle"
                return result
            self.phase = "apply"
            if bn_new is not None:
                offset = 0
                for k in self.pieces:
                    n = self.bn[k].numel
                    self.bn[k].load_flat(bn_new[offset: offset + n])
                    offset += n
            for bn in self.bn.values():
                bn.settle()  # a failure after this step (at its boundary) must not undo it
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if replica_update is not None:
                self.replica_of_successor.apply(replica_update)
                self.replica_of_successor.end_step(applied=True)
            self.phase = "idle"
            return result

        # (With BatchNorm's "first" statistics over several replicas one more collective follows
        # the stats: a step interrupted there is not finished from another member's stats.)
        self.pending_commit = None if first_bn else (step, lambda st: commit(st, bn_new))
        stats = yield AllSum(stats)
        if self.fault_point is not None:
            self.fault_point("after_reduction")  # (a "lose" fault here: the stats missed this member)
        self.pending_commit = None
        self.last_commit = (step, stats.clone())
        if first_bn:
            bn_new = yield from self._sum_by_stage(vec, False, True, False)
        return commit(stats, bn_new)

    # ---- no-flush schedules (2BW, asynchronous PipeDream) ---------------------------------------
    def _snapshot(self, k: int) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone().requires_grad_(t.requires_grad)
                for name, t in self.pieces[k].named_parameters()}

    def load_prev_version(self, versions: dict[int, dict[str, torch.Tensor]]) -> None:
        """Adopt another worker's older weight version (2BW state moved to a newcomer)."""
        out = {}
        for k, v in versions.items():
            params = dict(self.pieces[int(k)].named_parameters())
            out[int(k)] = {n: t.detach().clone().requires_grad_(params[n].requires_grad) for n, t in v.items()}
        self.prev_version = out

    def _stream(self, first_step: int, n_steps: int, control: int) -> Generator[Request, Any, list[StepResult]]:
        vns = self.assignment[self.replica]
        m = len(vns)
        schedule = schedule_for(self.pipeline, m, n_steps)
        V = self.plan.virtual_nodes
        self.model.train()
        (k,) = self.pieces  # v = 1 for the no-flush schedules
        piece = self.pieces[k]
        names = [n for n, q in piece.named_parameters() if q.requires_grad]
        rule = schedule.weight_rule
        current = self._snapshot(k)  # the weights after all updates so far
        prev, self.prev_version = self.prev_version, None  # from here on only `versions` holds them
        versions = {"current": current,  # "older": the weights after one update fewer (2bw only)
                    "older": (prev[k] if prev is not None else current) if rule == "delay1" else None}
        del current, prev
        done_in_step: dict[int, int] = {}
        acc: dict[int, list[torch.Tensor]] = {}
        leaves: dict[int, dict[int, torch.Tensor]] = {}
        losses: dict[int, dict[int, torch.Tensor]] = {}
        results: list[StepResult] = []
        mbs: dict[tuple[int, int], _MB] = {}
        compute = [0.0]
        applied = [first_step]  # updates applied on this piece so far (one per step)
        tree_loss: dict[int, float] = {}

        def forward(k_: int, mb: int, step: int, vn: int, message) -> _MB:
            ctx = _MB()
            if rule == "delay1":
                # step t runs on the weights after max(t-1, 0) updates; two versions are live
                want = max(step - 1, 0)
                if want == applied[0]:
                    ctx.version = versions["current"]
                elif want == applied[0] - 1:
                    ctx.version = versions["older"]
                else:  # the schedule checker proves this cannot happen
                    raise RuntimeError(f"2bw: step {step} needs version {want}, piece {k_} holds "
                                       f"{applied[0] - 1} and {applied[0]}")
            else:
                ctx.version = versions["current"]
            x = self._inputs(k_, step, vn, message, ctx)
            out = torch.func.functional_call(piece, ctx.version, (x,), strict=False)
            self._finish_forward(k_, step, vn, out, ctx)
            if k_ == self.last:
                losses.setdefault(step, {})[vn] = ctx.outputs[0].detach()
            return ctx

        def backward(kind: str, k_: int, mb: int, ctx: _MB) -> None:
            outs, grads = self._grad_pairs(ctx)
            wants_input = [t for t in ctx.inputs if t.is_floating_point()]
            weights = [ctx.version[n] for n in names]
            got = torch.autograd.grad(outs, weights + wants_input, grads, allow_unused=True)
            gw, gi = got[: len(weights)], got[len(weights):]
            if wants_input:
                ctx.in_grads = self._input_grads(ctx, gi)
            step, vn = self._vn_of(first_step, mb, m)
            flat = [g if g is not None else torch.zeros_like(w) for g, w in zip(gw, weights)]
            if self.deterministic:
                leaves.setdefault(step, {})[vn] = (torch.cat([g.reshape(-1) for g in flat]) if flat
                                                   else torch.zeros(0, device=self.device))
            elif step in acc:
                for a_, g in zip(acc[step], flat):
                    a_.add_(g)
            else:
                acc[step] = [g.clone() for g in flat]

        def on_backward_done(k_: int, mb: int, ctx: _MB):
            step, _ = self._vn_of(first_step, mb, m)
            done_in_step[step] = done_in_step.get(step, 0) + 1
            if done_in_step[step] < m:
                return
            # the last backward of `step` on this piece: reduce over replicas and apply
            if self.deterministic:
                step_leaves = leaves.pop(step)
                is_last = k_ == self.last

                def leaf(vn: int) -> torch.Tensor:
                    v = step_leaves.pop(vn)
                    return torch.cat([v, losses[step][vn].reshape(1)]) if is_last else v

                nodes = tree_reduce_local(self.tree.per_worker[self.replica], leaf)
                total = yield StageTree(self.tree, nodes, next(iter(nodes.values())))
                if is_last:
                    tree_loss[step] = float(total[-1])  # summed along the VN tree, as the VN engine does
            else:
                parts = acc.pop(step)
                total = torch.cat([g.reshape(-1) for g in parts]) if parts else torch.zeros(0, device=self.device)
                if self.replicas > 1:
                    total = yield StageSum(total)
            offset = 0
            for n, q in zip(names, (dict(piece.named_parameters())[n] for n in names)):
                q.grad = total[offset: offset + q.numel()].view_as(q).clone()
                offset += q.numel()
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            versions["older"] = versions["current"] if rule == "delay1" else None
            versions["current"] = self._snapshot(k_)
            applied[0] += 1

        self.phase = "compute"
        compute[0] = yield from self._run_actions(schedule, first_step, mbs, forward=forward, backward=backward,
                                                  on_backward_done=on_backward_done)
        self.prev_version = {k: versions["older"]} if rule == "delay1" else None
        # Window end: losses and bad VNs of every step, from the last piece.
        stats = torch.zeros(n_steps, V + 2, dtype=torch.float64, device=self.device)
        if k == self.last:
            for i in range(n_steps):
                t = first_step + i
                for v in vns:
                    stats[i, v] = float(not torch.isfinite(losses[t][v]).item())
                if self.deterministic:
                    stats[i, V + 1] = tree_loss[t] if self.replica == 0 else 0.0
                else:
                    stats[i, V + 1] = float(torch.stack([losses[t][v] for v in vns]).sum())
        stats[n_steps - 1, V] = control  # commands act at the window's end, where the pipeline is drained
        stats = yield AllSum(stats.reshape(-1))
        stats = stats.reshape(n_steps, V + 2)
        for i in range(n_steps):
            bad = [v for v in range(V) if stats[i, v] > 0]
            results.append(StepResult(first_step + i, float(stats[i, V + 1]), bad,
                                      int(round(float(stats[i, V]))), compute[0] / n_steps))
        self.phase = "idle"
        return results


class StageReplica:
    """A copy of another worker's stage (Bamboo's redundant stage): its pieces, optimizer and
    scheduler, taking the same update as the original from the original's reduced gradients.

    The update is the original's own code on the same values (same module structure, optimizer
    class and hyperparameters, scheduler, gradients, BatchNorm statistics and buffers), so the
    replica equals the original bit for bit after every step, whatever the optimizer.
    """

    def __init__(self, pieces: dict[int, nn.Module], optimizer_factory: Callable[[Any], torch.optim.Optimizer],
                 scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None, stage_rank: int) -> None:
        self.stage_rank = stage_rank
        self.pieces = dict(sorted(pieces.items()))
        self.model = nn.Sequential(OrderedDict(
            (name, layer) for k in self.pieces for name, layer in self.pieces[k].named_children()
        ))
        self.params = [q for q in self.model.parameters() if q.requires_grad]
        self.optimizer = optimizer_factory(self.model.parameters()) if self.params else _NoOptimizer()
        self.scheduler = (scheduler_factory(self.optimizer) if scheduler_factory is not None and self.params
                          else None)
        self.bn = {k: _PieceBatchNorm(m) for k, m in self.pieces.items()}
        self.clone_input = any(getattr(mod, "inplace", False) for m in self.pieces.values()
                               for mod in next(iter(m.children()), nn.Identity()).modules())
        self.refresh_s = 0.0
        """Time spent taking the original's steps (the redundant compute), in seconds."""
        self.eager: dict[tuple[int, int], _Eager] = {}
        """This step's eager forwards, (step, VN) -> forward (``Pipeline.redundant_compute``)."""
        self.forward_s = 0.0
        """Time spent in eager redundant forwards, in seconds."""
        self.forwards = 0
        """Eager redundant forwards run."""
        self.skipped = 0
        """Forwards no idle slot was left for (a failover recomputes them)."""
        self.last_forward_s: float | None = None
        self.kept_bytes = 0
        self.peak_kept_bytes = 0
        """The most bytes one step's eager forwards held (activations their graphs saved and their
        outputs; the weights they share with the replica not counted)."""

    def forward_est(self, default: float) -> float:
        """Seconds the next eager forward should take: the last one's, else ``default``."""
        return self.last_forward_s if self.last_forward_s is not None else default

    def begin_step(self) -> None:
        """A step starts: the forwards of earlier steps go; BatchNorm statistics are restored to
        this point before each eager forward."""
        self.eager.clear()
        self.kept_bytes = 0
        for bn in self.bn.values():
            if bn:
                bn.snapshot()

    def rewind(self) -> None:
        """Undo what eager forwards did to the replica's buffers (an interrupted step)."""
        for bn in self.bn.values():
            if bn and bn._start:
                bn.restore()

    def end_step(self, applied: bool) -> None:
        """The step committed (``applied``) or was skipped: its eager forwards go."""
        if not applied:
            self.rewind()
        for bn in self.bn.values():
            bn.settle()
        self.eager.clear()
        self.kept_bytes = 0

    def apply(self, message: list[torch.Tensor]) -> None:
        """The original's step: ``message`` = [its reduced gradients (flat) | its new BatchNorm
        statistics (or empty) | its buffers after the step's forwards]."""
        t0 = time.perf_counter()
        self._apply(message)
        self.refresh_s += time.perf_counter() - t0

    def _apply(self, message: list[torch.Tensor]) -> None:
        grads, bn_new, *buffers = message
        with torch.no_grad():
            for b, value in zip(self.model.buffers(), buffers):
                b.copy_(value)
        if bn_new.numel():
            offset = 0
            for k in self.pieces:
                n = self.bn[k].numel
                self.bn[k].load_flat(bn_new[offset: offset + n])
                offset += n
        offset = 0
        for q in self.params:  # views of the message (a buffer of its own), dropped after the step
            q.grad = grads[offset: offset + q.numel()].view_as(q)
            offset += q.numel()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("lr_scheduler") is not None:
            self.scheduler.load_state_dict(state["lr_scheduler"])

    def nbytes(self) -> int:
        """Bytes the replica holds: parameters, buffers and optimizer state."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [v for st in getattr(self.optimizer, "state", {}).values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


class _PieceBatchNorm:
    """The BatchNorm running statistics of one piece, restored between micro-batches by giving
    each layer *fresh* buffer tensors: a micro-batch's backward may still need the buffers its
    forward saw (the VN engine's in-place restore is safe only because it never interleaves
    micro-batches). Flat layout as :class:`virtualflow.runtime.engine.BatchNormState`: per layer,
    running mean then running variance."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = [m for m in module.modules()
                       if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self.numel = sum(m.running_mean.numel() + m.running_var.numel() for m in self.layers)
        self._start: list[tuple[torch.Tensor, ...]] = []

    def __bool__(self) -> bool:
        return bool(self.layers)

    def snapshot(self) -> None:
        self._start = [(m.running_mean.detach().clone(), m.running_var.detach().clone(),
                        m.num_batches_tracked.detach().clone()) for m in self.layers]

    def restore(self) -> None:
        for m, (mean, var, count) in zip(self.layers, self._start):
            m.running_mean, m.running_var, m.num_batches_tracked = mean.clone(), var.clone(), count.clone()

    def settle(self) -> None:
        """The step is over (applied or skipped): nothing to restore if what follows fails."""
        self._start = []

    def flat(self) -> torch.Tensor:
        parts = [t.detach().reshape(-1) for m in self.layers for t in (m.running_mean, m.running_var)]
        return torch.cat(parts) if parts else torch.zeros(0)

    def load_flat(self, flat: torch.Tensor) -> None:
        offset = 0
        for m in self.layers:
            for name in ("running_mean", "running_var"):
                old = getattr(m, name)
                n = old.numel()
                setattr(m, name, flat[offset: offset + n].view_as(old).clone())
                offset += n


class _NoOptimizer:
    """The optimizer of a worker without parameters: nothing to update, an empty state."""

    param_groups: list = []

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _recv_key(a: Any) -> MsgKey:
    """The message key a RECV_F / RECV_B action waits for."""
    return ("F", a.stage - 1, a.microbatch) if a.kind == "RECV_F" else ("B", a.stage + 1, a.microbatch)


def _forward_message(ctx: _MB) -> list[torch.Tensor]:
    rng = ctx.rng
    extra = list(rng) if isinstance(rng, tuple) else [rng]
    return [o.detach() for o in ctx.outputs] + extra
