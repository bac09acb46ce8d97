"""A pipelined job inside a worker process: the process driver of :mod:`runtime.pipeline` and the
engine the worker's generation loop (:mod:`runtime.worker`) runs for a job with a pipeline.

Layout. Generation rank ``r`` is stage-rank ``r % p`` of pipeline replica ``r // p``; a
generation's size must be a multiple of ``p`` (whole pipelines). Activations and gradients move
point to point over the generation's group; each stage-rank's replicas reduce their gradients
over their own group (``gen/<g>/stage<s>``); one small all-reduce over the whole group per step
carries losses, bad VNs and the control position. A resize adds or removes whole replicas: a
survivor keeps its stage-rank (members keep their order), a newcomer receives its stage's state
(pieces, optimizer, scheduler, 2BW's older weights) from a member of the same stage that reached
the step. A failure leaves the job its whole replicas (see ``control/membership.py``); with
Bamboo's redundancy the hit replica fails over instead, one worker shorter (:meth:`_relayout`:
replicas may then differ in depth, and a worker running several job stages joins each stage's
group).

Every worker builds the whole model once from the job's seed (so all pieces start from the
unpipelined model's initial weights) and keeps the layers of its stage-rank for training; rank 0
also keeps the whole model to assemble checkpoints, the final state and evaluation, gathered
from the first replica's stages (:meth:`PipelineWorkerEngine.gather_state`, a collective).

Message format (point to point; see :func:`drive`): a fixed-size int64 header (a flag, the tensor
count, then per tensor its dtype code, rank and shape) and one packed payload; tags are unique per
(direction, piece, micro-batch, part), so messages between the same two workers can never be
confused. Headers come from a peer of the same job but are still parsed defensively: a malformed
one is a :class:`PeerFailure` (the generation is formed again), never an exception in the job.

Measured (``bench/pipeline.py``): the first protocol, a header then one blocking receive per
tensor, each posted only when needed, cost 2-3 round trips per hop (1.4-2.0x torch.distributed.
pipelining's step time at p = 2); posting receives ahead and packing the payload removed them.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator

import torch

from virtualflow.comm.groups import Arrival, Group, PeerFailure
from virtualflow.comm.reduce import tree_exchange
from virtualflow.pipeline import Grid, Pipeline, check_workers, layers_of, resolve_bounds
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.engine import BatchLoader, StepOutcome
from virtualflow.runtime.engines import Boundary, Joining
from virtualflow.runtime.pipeline import AllSum, Expect, Poll, Recv, Send, StageEngine, StageSum, StageTree, StepResult, _Reuse
from virtualflow.runtime.transfer import broadcast_state

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_HEADER = 128
_ALIGN = 16
# tag parts of one message: 0 header, 1 payload of the link's reference shapes, 2 payload of new shapes
_PARTS = 4
_SAME, _NEW, _CHANGED = 0, 1, 2


def _tag(key: tuple[str, int, int], n_pieces: int, part: int) -> int:
    direction, piece, mb = key
    if direction == "R":  # a replica update (one per step and link; steps are sequential)
        return 2 ** 30 + piece * _PARTS + part
    return (((mb * n_pieces + piece) * 2 + (direction == "B")) * _PARTS + part) % (2 ** 31 - 1)


Metas = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def _metas(tensors: list[torch.Tensor]) -> Metas:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _header(flag: int, metas: Metas) -> torch.Tensor:
    h = [flag, len(metas)]
    for dtype, shape in metas:
        h += [_DTYPES.index(dtype), len(shape), *shape]
    if len(h) > _HEADER:
        raise ValueError(f"a pipeline message of {len(metas)} tensors {[m[1] for m in metas]} does not fit the "
                         f"{_HEADER}-entry header; pass fewer, lower-rank tensors between stages")
    return torch.tensor(h + [0] * (_HEADER - len(h)), dtype=torch.int64)


def _parse(header: torch.Tensor) -> tuple[int, Metas]:
    h = header.tolist()
    flag, n = int(h[0]), int(h[1])
    if flag not in (_SAME, _NEW, _CHANGED) or not 0 <= n <= _HEADER:
        raise ValueError(f"malformed pipeline message header {h[:16]}")
    out, i = [], 2
    for _ in range(n):
        if i + 2 > _HEADER:
            raise ValueError(f"malformed pipeline message header {h[:16]}")
        code, ndim = int(h[i]), int(h[i + 1])
        if not (0 <= code < len(_DTYPES)) or not (0 <= ndim <= 16) or i + 2 + ndim > _HEADER:
            raise ValueError(f"malformed pipeline message header {h[:16]}")
        shape = tuple(int(x) for x in h[i + 2: i + 2 + ndim])
        if any(d < 0 for d in shape):
            raise ValueError(f"malformed pipeline message header {h[:16]}")
        out.append((_DTYPES[code], shape))
        i += 2 + ndim
    return flag, tuple(out)


def _layout(metas: Metas) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed payload (aligned), and the payload's size."""
    offsets, size = [], 0
    for dtype, shape in metas:
        offsets.append(size)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        size += -(-n // _ALIGN) * _ALIGN
    return offsets, size


def _pack(tensors: list[torch.Tensor], metas: Metas, device: torch.device, flag: int | None = None) -> torch.Tensor:
    """One buffer: [flag (``_ALIGN`` bytes, when given) | each tensor's bytes, aligned]."""
    offsets, size = _layout(metas)
    start = _ALIGN if flag is not None else 0
    buf = torch.empty(start + size, dtype=torch.uint8, device=device)
    if flag is not None:
        buf[:_ALIGN].zero_()
        buf[:8].view(torch.int64).fill_(flag)
    for t, off in zip(tensors, offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[start + off: start + off + raw.numel()].copy_(raw)
    return buf


def _unpack(buf: torch.Tensor, metas: Metas, start: int = 0) -> list[torch.Tensor]:
    offsets, _ = _layout(metas)
    out = []
    for (dtype, shape), off in zip(metas, offsets):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buf[start + off: start + off + n].view(dtype).reshape(shape))
    return out


class Links:
    """Per link (direction, sending piece): the shapes of its last message in the previous drive
    (step or window). Sender and receiver keep the same table (they see the same messages in the
    same order), so a receiver can post a message's payload before it arrives, and the sender
    knows whether that posted buffer fits. Reset with every generation."""

    def __init__(self) -> None:
        self.ref: dict[tuple[str, int], Metas] = {}
        self.last: dict[tuple[str, int], Metas] = {}

    def end_of_drive(self) -> None:
        self.ref.update(self.last)
        self.last = {}


_ABANDONED: list[Any] = []
"""Sends a failed drive left unfinished, with their buffers: kept alive (gloo's transport may still
read a buffer) instead of waited on - a send to a live peer that has stopped receiving would block
until the group's timeout."""


def drive(gen: Generator, *, group: Group, stage_group: Group, grid: Grid, n_pieces: int,
          device: torch.device, links: Links | None = None,
          stage_groups: dict[int, Group] | None = None) -> list[StepResult]:
    """Answer a :class:`StageEngine` generator's requests with real communication.

    Receives are posted when the engine announces them (:class:`Expect`), so a message moves as
    soon as it is sent. On a link whose shapes are known (its reference, see :class:`Links`), a
    message is ONE buffer on tag part 1: a flag, then every tensor of the message (generator state
    included) packed; the receiver posted exactly that size. On a new link, or when the shapes
    change, the sender sends a header (flag and shapes) on part 0 and the packed payload on part
    2 (after, on a known link, a part-1 buffer flagged ``_CHANGED`` to complete the posted
    receive). So the common case costs one message per hop, as hand-written pipelines do.

    A :class:`StageSum` / :class:`StageTree` naming a job stage goes over that stage's group in
    ``stage_groups`` (a worker running several stages after a Bamboo failover), else over
    ``stage_group``.
    """
    links = links if links is not None else Links()
    pending: list[tuple[Any, list[torch.Tensor]]] = []
    posted: dict[tuple[str, int, int], tuple[Any, torch.Tensor, Metas | None]] = {}
    arrivals: dict[tuple[str, int, int], Arrival] = {}
    answer: Any = None

    def post(peer_rank: int, key: tuple[str, int, int]) -> None:
        ref = links.ref.get((key[0], key[1]))
        if ref is None:  # a new link: the header comes first
            buf = torch.empty(_HEADER, dtype=torch.int64, device=device)
            work = group.irecv(buf, peer_rank, _tag(key, n_pieces, 0))
        else:
            buf = torch.empty(_ALIGN + _layout(ref)[1], dtype=torch.uint8, device=device)
            work = group.irecv(buf, peer_rank, _tag(key, n_pieces, 1))
        posted[key] = (work, buf, ref)

    def header_then_payload(src: int, key: tuple[str, int, int], header: torch.Tensor | None) -> list[torch.Tensor]:
        if header is None:
            header = torch.empty(_HEADER, dtype=torch.int64, device=device)
            group.recv(header, src, _tag(key, n_pieces, 0))
        try:
            flag, metas = _parse(header.cpu())
        except ValueError as exc:
            raise PeerFailure(group.generation, str(exc)) from None
        payload = torch.empty(_layout(metas)[1], dtype=torch.uint8, device=device)
        group.recv(payload, src, _tag(key, n_pieces, 2))
        links.last[(key[0], key[1])] = metas
        return _unpack(payload, metas)

    failed = False
    try:
        req = next(gen)
        while True:
            if isinstance(req, Expect):
                post(grid.rank_of(grid.replica, req.peer), req.key)
                answer = None
            elif isinstance(req, Send):
                dst = grid.rank_of(grid.replica, req.peer)
                link = (req.key[0], req.key[1])
                metas = _metas(req.tensors)
                ref = links.ref.get(link)
                if ref is not None and metas == ref:
                    buf = _pack(req.tensors, metas, device, flag=_SAME)
                    works, keep = [group.isend(buf, dst, _tag(req.key, n_pieces, 1))], [buf]
                else:
                    works, keep = [], []
                    if ref is not None:  # complete the receive posted for the reference's size
                        filler = torch.zeros(_ALIGN + _layout(ref)[1], dtype=torch.uint8, device=device)
                        filler[:8].view(torch.int64).fill_(_CHANGED)
                        works.append(group.isend(filler, dst, _tag(req.key, n_pieces, 1)))
                        keep.append(filler)
                    header = _header(_NEW if ref is None else _CHANGED, metas).to(device)
                    payload = _pack(req.tensors, metas, device)
                    works.append(group.isend(header, dst, _tag(req.key, n_pieces, 0)))
                    works.append(group.isend(payload, dst, _tag(req.key, n_pieces, 2)))
                    keep += [header, payload]
                links.last[link] = metas
                pending.append((works, keep))
                answer = None
            elif isinstance(req, Poll):
                if req.key not in posted:
                    post(grid.rank_of(grid.replica, req.peer), req.key)
                if req.key not in arrivals:
                    arrivals[req.key] = Arrival(posted[req.key][0])
                answer = arrivals[req.key].done.is_set()
            elif isinstance(req, Recv):
                src = grid.rank_of(grid.replica, req.peer)
                if req.key not in posted:
                    post(src, req.key)
                work, buf, ref = posted.pop(req.key)
                arrival = arrivals.pop(req.key, None) or Arrival(work)
                arrival.wait(group)
                if ref is None:
                    answer = header_then_payload(src, req.key, buf)
                else:
                    flag = int(buf[:8].view(torch.int64).item())
                    if flag == _SAME:
                        links.last[(req.key[0], req.key[1])] = ref
                        answer = _unpack(buf, ref, start=_ALIGN)
                    elif flag == _CHANGED:
                        answer = header_then_payload(src, req.key, None)
                    else:
                        raise PeerFailure(group.generation, f"pipeline message with unknown flag {flag}")
            elif isinstance(req, StageSum):
                (stage_group if req.stage is None else stage_groups[req.stage]).all_reduce(req.vector)
                answer = req.vector
            elif isinstance(req, StageTree):
                answer = tree_exchange(req.plan, stage_group if req.stage is None else stage_groups[req.stage],
                                       req.nodes, like=req.like)
            elif isinstance(req, AllSum):
                group.all_reduce(req.vector)
                answer = req.vector
            else:
                raise TypeError(f"unknown pipeline request {req!r}")
            req = gen.send(answer)
    except StopIteration as stop:
        results = stop.value
    except BaseException:
        failed = True
        raise
    finally:
        if failed:  # the caller closes the group; the peers may not be receiving any more
            _ABANDONED.extend(pending)
            del _ABANDONED[:-256]
        else:
            for works, _keep in pending:
                for w in works:
                    try:
                        w.wait()
                    except PeerFailure:
                        pass
    if posted:
        raise RuntimeError(f"pipeline receives announced but never taken: {sorted(posted)[:4]}")
    links.end_of_drive()
    return results


class PipelineWorkerEngine:
    """The worker's engine for a pipelined job (same role as :class:`runtime.engine.VNEngine`)."""

    pipelined = True

    def __init__(self, job: Any, dataset: Any, *, deterministic: bool, device: torch.device,
                 subgroup: Callable[[int, str, int, int], Group]) -> None:
        self.job = job
        self.pipeline: Pipeline = job.pipeline
        self.dataset = dataset
        self.deterministic = deterministic
        self.device = device
        self.subgroup = subgroup
        torch.manual_seed(job.seed)
        self.model: torch.nn.Module | None = job.model().to(device)
        """The whole model: built once from the seed so every piece starts from the unpipelined
        model's weights, dropped once this worker's pieces are cut from it (only they stay in
        memory); rebuilt on rank 0 when a checkpoint, an evaluation or the final state needs it."""
        self.layers: list[torch.nn.Module] | None = layers_of(self.model)
        self.bounds = resolve_bounds(self.pipeline, len(self.layers))
        self.plan = DataPlan(len(dataset), job.global_batch_size, job.virtual_nodes, job.seed)
        self.stage: StageEngine | None = None
        self.group: Group | None = None
        self.stage_group: Group | None = None
        self.stage_groups: dict[int, Group] = {}
        """Per job stage this worker runs, the group of the workers running it in every replica
        (``stage_group`` is the first; more than one after a Bamboo failover)."""
        self.grid: Grid | None = None
        self.phase = "idle"
        self.slowdown = 1.0
        self.generation_broken = None
        self.total_steps: int | None = None
        self._results: dict[int, StepOutcome] = {}
        self._broken_window = False
        self.resume_state: dict[str, Any] | None = None
        """A state (checkpoint) to start from: loaded when the worker learns its stage."""
        self._fault: Callable[[int, str], None] | None = None
        self.full_bounds = self.bounds
        """Layer ranges of the job's own stages (``self.bounds`` are those of the current layout)."""
        self.layout: tuple[tuple[int, ...], ...] | None = None
        """After a Bamboo failover: the job stages each member runs (None: one per member)."""
        self.group_rank = 0
        self._pending: tuple[int, Callable[[torch.Tensor], Any]] | None = None
        """A step interrupted in its stats all-reduce (see :meth:`settle_commit`)."""
        self._settled: tuple[int, list[int]] | None = None
        self._relaid = -1
        self.relayout_bytes = 0
        """Bytes moved between the members in the last re-layout (a failover or a reconfiguration)."""
        self.timeline_dir: str | None = None
        """Where recorded timelines go (``Pipeline.record_timeline``); set by the worker."""
        self._due: tuple[bool, bool] = (False, False)
        """A checkpoint / an evaluation fell due inside a no-flush window (done at its end)."""
        self.redundant_totals = [0.0, 0, 0, 0, 0]
        """Eager redundant forwards of the engines this worker dropped at re-layouts: seconds,
        forwards run, forwards skipped (no idle slot), forwards a redone step reused, the most
        bytes one step's forwards kept."""

    def redundant_forwards(self) -> dict[str, float]:
        """Eager redundant forwards of this worker over the whole run (``Result.redundant_forwards``)."""
        s, n, skipped, reused, peak = self.redundant_totals
        replica = self.stage.replica_of_successor if self.stage is not None else None
        if replica is not None:
            s, n, skipped = s + replica.forward_s, n + replica.forwards, skipped + replica.skipped
            peak = max(peak, replica.peak_kept_bytes)
        if self.stage is not None:
            reused += self.stage.reused_forwards
        return {"seconds": s, "forwards": n, "skipped": skipped, "reused": reused, "peak_bytes": peak}

    @property
    def optimizer(self):
        return self.stage.optimizer if self.stage is not None else None

    @property
    def scheduler(self):
        return self.stage.scheduler if self.stage is not None else None

    def install_fault_point(self, fn) -> None:
        """Call ``fn(step, phase)`` at each fault-injection point of a step (runtime/faults.py)."""
        self._fault = fn

    def _build_stage(self, stage_rank: int) -> None:
        from virtualflow.pipeline import piece_module, successor_pieces, tied_for_worker

        p = self.pipeline.stages
        pieces = {k: piece_module(self.layers, a, b) for k, (a, b) in enumerate(self.bounds) if k % p == stage_rank}
        job = self.job
        self.stage = StageEngine(
            pieces=pieces, n_pieces=len(self.bounds), stage_rank=stage_rank, optimizer_factory=job.optimizer,
            scheduler_factory=job.lr_scheduler, pipeline=self.pipeline, plan=self.plan,
            loader=BatchLoader(self.dataset, job.collate_fn), model_input=job.input_of, output_loss=job.output_loss,
            seed=job.seed, batchnorm=job.batchnorm, deterministic=self.deterministic, device=self.device,
            tied=tied_for_worker(self.layers, self.bounds, p, stage_rank),
            successor_pieces=successor_pieces(self.pipeline, self.layers, self.bounds, stage_rank),
        )

    def set_membership(self, group: Group, assignment: Any, layout: list[list[int]] | None = None,
                       steps: list[int] | None = None, target: int | None = None) -> None:
        if self._broken_window:
            raise RuntimeError(
                f"a failure interrupted a {self.pipeline.schedule} window after some stages had applied its updates; "
                f"a no-flush pipeline cannot redo it consistently. Use a flush schedule (1f1b, ...) for a job that "
                f"must survive failures, or a shorter Pipeline.window"
            )
        if steps is not None and target is not None:
            steps = self.settle_commit(group, steps, target)
        if layout is not None:  # Bamboo: a failover or a reconfiguration (one pipeline replica)
            self._relayout(group, layout, steps, target)
            return
        if self.layout is not None:
            raise RuntimeError("a failed-over pipeline changes its membership only through a layout")
        d = check_workers(self.pipeline, group.size)
        grid = Grid(self.pipeline.stages, d, group.rank)
        if self.stage is None:
            self._build_stage(grid.stage_rank)
            if self.resume_state is not None:
                self._resume(self.resume_state, grid.stage_rank)
                self.resume_state = None
            self.model, self.layers = None, None  # keep only this worker's pieces
        elif self.stage.stage_rank != grid.stage_rank:
            raise RuntimeError(
                f"worker moved from stage-rank {self.stage.stage_rank} to {grid.stage_rank}; a pipelined job "
                f"resizes in whole pipeline replicas and its survivors keep their stage"
            )
        self._adopt(group, grid, contiguous_assignment(self.job.virtual_nodes, d))

    def _adopt(self, group: Group, grid: Grid, assignment: list[list[int]],
               job_stages: tuple[int, ...] | None = None) -> None:
        """Join the generation: its groups (one per job stage this worker runs, ``job_stages``; by
        default its stage-rank's), its place in its replica, the replicas' VNs."""
        self._close_stage_groups()
        names = job_stages if job_stages is not None else (grid.stage_rank,)
        # In increasing stage order on every worker, so building them cannot deadlock.
        self.stage_groups = {s: self.subgroup(group.generation, f"stage{s}", grid.replica, grid.replicas)
                             for s in sorted(names)}
        for g in self.stage_groups.values():  # broken with its generation: its waits end on the abort flag too
            g.abort_check = group.abort_check
        self.stage_group = self.stage_groups[min(names)]
        self.stage.set_layout(grid.replica, assignment)
        self.stage.slowdown = self.slowdown
        self.stage.fault_point = None
        self.group, self.grid = group, grid
        self.links = Links()  # a new generation: new peers, no shared history
        self._results = {}

    def _close_stage_groups(self) -> None:
        for g in self.stage_groups.values():
            if g.pg is not None:
                g.close()
        self.stage_groups = {}
        self.stage_group = None

    # ---- Bamboo: failover and reconfiguration ---------------------------------------------------
    def _stages_held(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(stages this worker runs, stages its replica holds), in the job's stage numbering."""
        if self.stage is None:
            return (), ()
        if self.layout is None:
            p = self.pipeline.stages
            own = (self.stage.stage_rank,)
            rep = ((self.stage.stage_rank + 1) % p,) if self.stage.replica_of_successor is not None else ()
            return own, rep
        own = self.layout[self.group_rank]
        if self.stage.replica_of_successor is None:  # a replica of one worker keeps no replica
            return own, ()
        return own, self.layout[_successor(self.layout, self.pipeline.stages, self.group_rank)]

    def _stage_states(self, holder: Any, stages: tuple[int, ...]) -> dict[int, dict[str, Any]]:
        """Per job stage, the state ``holder`` (a StageEngine or StageReplica running ``stages``)
        keeps: its layers' tensors, its parameters' optimizer state (one parameter group), the
        scheduler state."""
        model_state = holder.model.state_dict()
        opt = holder.optimizer.state_dict()
        if len(opt["param_groups"]) > 1:
            raise RuntimeError("a Bamboo failover moves optimizer state stage by stage and supports optimizers "
                               "with one parameter group; this job's has several")
        params = [name for name, _ in holder.model.named_parameters()]  # the optimizer's order
        sched = holder.scheduler.state_dict() if holder.scheduler is not None else None
        out = {}
        for s in stages:
            a, b = self.full_bounds[s]
            mine = lambda name: a <= int(name.split(".")[0]) < b  # noqa: E731 - layer index of a name
            idx = [i for i, name in enumerate(params) if mine(name)]
            group = {k: v for k, v in opt["param_groups"][0].items() if k != "params"} if opt["param_groups"] else {}
            out[s] = {
                "model": {k: v.detach().clone() for k, v in model_state.items() if mine(k)},
                "optimizer": {"state": {j: opt["state"][i] for j, i in enumerate(idx) if i in opt["state"]},
                              "param_groups": [{**group, "params": list(range(len(idx)))}] if idx else []},
                "lr_scheduler": sched,
            }
        return out

    def _relayout(self, group: Group, layout: list[list[int]], steps: list[int] | None, target: int | None) -> None:
        """Adopt a Bamboo layout (one run of stages per member, pipeline replica after replica;
        a replica starts at the run holding stage 0): every member ends up with the state of its
        own stages and a replica of its successor's in its replica, taken from its own pieces,
        its replica, or (a broadcast) from a member holding them. With several replicas, each
        job stage is reduced over the workers running it, one per replica, in replica order
        (:meth:`StageEngine.set_job_stages`). Collective."""
        from virtualflow.pipeline import Pipeline, bounds_from_counts, piece_module
        from virtualflow.plan.pipeline.failover import flatten, split_replicas

        p = self.pipeline.stages
        layouts = split_replicas(layout, p)
        new = flatten(layouts)
        if len(new) != group.size:
            raise RuntimeError(f"layout {layout} names {len(new)} workers; the generation has {group.size}")
        if steps is not None and target is not None and any(0 <= t != target for t in steps):
            raise RuntimeError(f"a failover needs every surviving worker at the same step (steps {steps}); a "
                               f"failure struck between the stages' updates of one step: resume from a checkpoint")
        if self.pipeline.chunks != 1:
            raise RuntimeError("a Bamboo failover needs chunks=1")
        own_old, rep_old = self._stages_held()
        old_replica = self.stage.replica_of_successor if self.stage is not None else None
        if old_replica is not None:
            self.redundant_totals[0] += old_replica.forward_s
            self.redundant_totals[1] += old_replica.forwards
            self.redundant_totals[2] += old_replica.skipped
            self.redundant_totals[4] = max(self.redundant_totals[4], old_replica.peak_kept_bytes)
        if self.stage is not None:
            self.redundant_totals[3] += self.stage.reused_forwards
        # Who holds what: 2 = runs the stage, 1 = holds its replica.
        held = torch.zeros(group.size, p, dtype=torch.float64)
        for s in rep_old:
            held[group.rank, s] = 1
        for s in own_old:
            held[group.rank, s] = 2
        group.all_reduce(held)
        n = len(new)
        local: dict[int, dict[str, Any]] = {}
        if self.stage is not None:
            local.update(self._stage_states(self.stage.replica_of_successor, rep_old) if rep_old else {})
            local.update(self._stage_states(self.stage, own_old))
        got: dict[int, dict[str, Any]] = {}
        self.relayout_bytes = 0
        for r in range(n):
            for s in sorted(set(new[r]) | set(new[_successor(new, p, r)])):
                if held[r, s] > 0:
                    if r == group.rank:
                        got[s] = local[s]
                    continue
                sources = [q for q in range(n) if held[q, s] == 2] or [q for q in range(n) if held[q, s] == 1]
                if not sources:
                    raise RuntimeError(f"no worker holds stage {s} (nor its replica): the pipeline cannot go on; "
                                       f"resume from a checkpoint")
                src = sources[0]
                state, nbytes = broadcast_state(group, src, local[s] if group.rank == src else None, self.device,
                                                receivers=[r])
                if group.rank == src:
                    self.relayout_bytes += nbytes
                if r == group.rank:
                    got[s] = state
        total = torch.tensor([float(self.relayout_bytes)], dtype=torch.float64)
        group.all_reduce(total)
        self.relayout_bytes = int(total.item())  # every member: the re-layout's bytes in all
        # Build this worker's pieces from the whole model's layers, loaded with the stages' states.
        grid = Grid(p, len(layouts), group.rank, sizes=tuple(len(rep) for rep in layouts))
        mine_rep = layouts[grid.replica]
        pos, m = grid.stage_rank, len(mine_rep)
        mine, succ = mine_rep[pos], mine_rep[(pos + 1) % m]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.job.seed)
            layers = [layer.to(self.device) for layer in layers_of(self.job.model())]
        whole = torch.nn.Sequential(*layers)
        whole.load_state_dict({k: v for s in set(mine) | set(succ) for k, v in got[s]["model"].items()},
                              strict=False)
        counts = [self.full_bounds[run[-1]][1] - self.full_bounds[run[0]][0] for run in mine_rep]
        self.layout = new
        self.group_rank = group.rank
        pipeline = Pipeline(stages=m, schedule=self.pipeline.schedule, split=counts, redundancy=m >= 2,
                            redundant_compute=self.pipeline.redundant_compute)
        self.bounds = bounds_from_counts(counts)
        a, b = self.bounds[pos]
        sa, sb = self.bounds[(pos + 1) % m]
        job = self.job
        self.stage = StageEngine(
            pieces={pos: piece_module(layers, a, b)}, n_pieces=m, stage_rank=pos,
            optimizer_factory=job.optimizer, scheduler_factory=job.lr_scheduler, pipeline=pipeline, plan=self.plan,
            loader=BatchLoader(self.dataset, job.collate_fn), model_input=job.input_of, output_loss=job.output_loss,
            seed=job.seed, batchnorm=job.batchnorm, deterministic=self.deterministic, device=self.device,
            successor_pieces={(pos + 1) % m: piece_module(layers, sa, sb)} if m >= 2 else None,
        )
        _load_merged(self.stage, [got[s] for s in mine])
        _load_merged(self.stage.replica_of_successor, [got[s] for s in succ])
        if old_replica is not None and old_replica.eager:
            # Eager redundant forwards of the interrupted step, of a stage this worker now runs:
            # the redone step takes them instead of running that stage's forwards again.
            lo = min(int(name) for mod in old_replica.pieces.values() for name, _ in mod.named_children())
            hi = max(int(name) for mod in old_replica.pieces.values() for name, _ in mod.named_children()) + 1
            if a <= lo and hi <= b and self.stage.pipeline.eager_forwards:
                self.stage.reuse = _Reuse(lo, hi, dict(old_replica.eager))
            old_replica.eager.clear()
        if len(layouts) > 1 and len(mine) > 1:
            self.stage.set_job_stages([(s, *self.full_bounds[s]) for s in mine])
        self.model, self.layers = None, None
        self._relaid = group.generation
        if all(len(run) == 1 for run in new):
            self.layout = None  # full depth again: the standard layout from here on
            grid = Grid(p, len(layouts), group.rank)
        self._adopt(group, grid, contiguous_assignment(self.job.virtual_nodes, len(layouts)), job_stages=mine)

    # ---- the worker's Engine protocol (runtime/engines.py) ---------------------------------------
    def resume_from(self, state: dict[str, Any]) -> None:
        self.resume_state = state  # loaded into the stage once its place is known

    def prepare_to_join(self) -> None:
        pass  # a newcomer's stage is built once its place is known

    def check_state_held(self, run_dir: str) -> None:
        pass  # what a failed member held comes back from its stage's survivors (or a replica)

    def adopt(self, joining: Joining) -> tuple[int, float]:
        record, group = joining.record, joining.group
        moved, t_transfer = 0, 0.0
        self.plan.set_vn_sizes(record.vn_sizes)
        self.set_membership(group, record.assignment, layout=record.layout, steps=joining.steps,
                            target=joining.target)
        if record.layout is not None:
            moved = self.relayout_bytes  # what the re-layout moved between the members
        if joining.behind:
            joining.transferring = True
            t1 = time.perf_counter()
            moved += self.transfer(group, joining.steps, joining.target)
            t_transfer = time.perf_counter() - t1
            joining.transferring = False
        return moved, t_transfer

    def before_regroup(self) -> None:
        pass  # every member keeps its own stage's state

    def whole_state(self, group: Group) -> dict[str, Any] | None:
        return self.gather_state(group)

    def boundary(self, group: Group, step: int, work: Boundary) -> None:
        """Checkpoint and evaluation of a pipelined job: every member takes part in the gather."""
        ck, ev = work.checkpoint_due(step), work.eval_due(step)
        # A no-flush schedule has computed its whole window already: what falls due inside a
        # window is done at the window's end, where the state is that of a step boundary.
        self._due = (self._due[0] or ck, self._due[1] or ev)
        if self.mid_window:
            return
        ck, ev = self._due
        self._due = (False, False)
        if not (ck or ev):
            return
        t_ck = time.perf_counter()
        state = work.whole_state(self, group, step)
        if state is None:
            return
        if ck:
            work.checkpointed(step, work.save_checkpoint(step, state, prune=False), t_ck)
        if ev:
            work.evaluate(self.model, step)
        self.model = None  # the whole model was rebuilt on rank 0 for this; only pieces stay

    def boundary_on_rank0(self, step: int, work: Boundary) -> None:
        pass  # its checkpoints and evaluations are collectives: :meth:`boundary`

    def hold(self, group: Group, step: int, work: Boundary) -> str | None:
        state = work.whole_state(self, group, step)  # rank 0 gathers the stages
        return work.save_checkpoint(step, state, prune=False) if group.rank == 0 else None

    def non_finite_note(self, step: int, path: str) -> str:
        if not self.pipeline.flush:
            return (f"the {self.pipeline.schedule} schedule streams steps without a flush, so the updates of its "
                    f"window were applied; the state after them is in {path}")
        return f"the step was not applied and the last good state (before step {step}) is in {path}"

    def final_report(self) -> dict[str, Any]:
        replica = self.stage.replica_of_successor if self.stage is not None else None
        return {"optimizer_bytes": 0, "replica_bytes": replica.nbytes() if replica else 0,
                "replica_refresh_s": replica.refresh_s if replica else 0.0,
                "redundant_forwards": self.redundant_forwards()}

    def state_bytes(self) -> int | None:
        return None  # spread over the stages: not told

    def close(self) -> None:
        pass  # no threads of its own

    def step(self, step: int, control: int = 0) -> StepOutcome:
        if step in self._results:
            return self._results.pop(step)
        n = 1
        if not self.pipeline.flush:
            end = self.total_steps if self.total_steps is not None else step + self.pipeline.window
            n = max(1, min(self.pipeline.window, end - step))
        self.stage.slowdown = self.slowdown
        fault = self._fault
        if fault is not None:
            fault(step, "before_forward")
            self.stage.fault_point = lambda phase: fault(step, phase)
        self.phase = "compute"
        results = drive(self.stage.steps(step, n, control), group=self.group, stage_group=self.stage_group,
                        grid=self.grid, n_pieces=len(self.bounds), device=self.device, links=self.links,
                        stage_groups=self.stage_groups)
        self.phase = "idle"
        if self.stage.timeline:
            self._write_timeline()
        out = {r.step: StepOutcome(r.loss, r.bad_vns, r.control, None) for r in results}
        first = out.pop(step)
        self._results = out
        return first

    @property
    def mid_window(self) -> bool:
        """True between the steps of a no-flush window (its later steps are already computed)."""
        return bool(self._results)

    def _write_timeline(self) -> None:
        """Append this worker's recorded actions to ``pipeline/timeline-<rank>.jsonl`` in the run's
        state directory (``virtualflow plot RUN_DIR --pipeline`` draws them)."""
        import json
        import os

        if self.timeline_dir is None:
            self.stage.timeline.clear()
            return
        os.makedirs(self.timeline_dir, mode=0o700, exist_ok=True)
        path = os.path.join(self.timeline_dir, f"timeline-{self.group.rank}.jsonl")
        g = self.grid
        with open(path, "a") as f:
            for e in self.stage.timeline:
                f.write(json.dumps({**e, "rank": self.group.rank, "replica": g.replica, "stage_rank": g.stage_rank,
                                    "generation": self.group.generation}) + "\n")
        self.stage.timeline.clear()

    def abandon_step(self) -> None:
        if self.stage is not None and not self.pipeline.flush:
            # Some stages may have applied updates of the interrupted window already: the window
            # cannot be redone consistently.
            self._broken_window = True
        self._pending = self.stage.pending_commit if self.stage is not None else None
        if self.stage is not None:
            self.stage.pending_commit = None
        if self.stage is not None and self._pending is None:
            self._discard_step()
        self._close_stage_groups()
        self.group = None
        self._results = {}
        self.phase = "idle"

    def _discard_step(self) -> None:
        for bn in self.stage.bn.values():
            bn.restore()  # back to the step's start; nothing changes once the step settled
        if self.stage.replica_of_successor is not None:
            self.stage.replica_of_successor.rewind()
        self.stage.optimizer.zero_grad(set_to_none=True)

    def settle_commit(self, group: Group, steps: list[int], target: int) -> list[int]:
        """A failure in a step's stats all-reduce can complete it on some members only: they
        applied the step, the others did not (their gradients are reduced: only the stats are
        missing). Those others finish the step now from the stats a member that completed it
        hands over, so that every stage reaches ``target`` again (without it, a stage whose
        every member missed the stats could not be made consistent). Collective only when the
        members' steps (known to all) differ by one; returns the steps after settling."""
        pending, self._pending = self._pending, None
        me = group.rank
        if not (target >= 1 and target - 1 in steps and target in steps):
            if pending is not None:
                self._discard_step()
            return steps
        mine = pending is not None and pending[0] == steps[me] == target - 1
        holds = self.stage is not None and self.stage.last_commit is not None and \
            self.stage.last_commit[0] == target - 1 and steps[me] == target
        flags = torch.zeros(2 * group.size, dtype=torch.float64, device=self.device)
        flags[2 * me], flags[2 * me + 1] = float(mine), float(holds)
        group.all_reduce(flags)
        waiting = [r for r in range(group.size) if flags[2 * r] > 0]
        sources = [r for r in range(group.size) if flags[2 * r + 1] > 0]
        if not waiting or not sources:
            if pending is not None:
                self._discard_step()
            return steps
        stats = self.stage.last_commit[1].clone() if me == sources[0] else \
            torch.zeros(self.job.virtual_nodes + 2, dtype=torch.float64, device=self.device)
        group.broadcast(stats, sources[0])
        if mine:
            pending[1](stats)
            self.stage.last_commit = (target - 1, stats)
        elif pending is not None:
            self._discard_step()
        settled = [target if r in waiting else s for r, s in enumerate(steps)]
        self._settled = (group.generation, settled)
        return settled

    # ---- state ---------------------------------------------------------------------------------
    def stage_state(self) -> dict[str, Any]:
        s = self.stage
        state = {"model": s.model.state_dict(), "optimizer": s.optimizer.state_dict(),
                 "lr_scheduler": s.scheduler.state_dict() if s.scheduler is not None else None}
        if s.prev_version is not None:  # 2bw: the older weight version is training state too
            state["prev_version"] = {k: {n: t.detach() for n, t in v.items()} for k, v in s.prev_version.items()}
        return state

    def _resume(self, state: dict[str, Any], stage_rank: int) -> None:
        """Load a gathered state (``gather_state``'s layout): the whole model, then this stage's
        optimizer and scheduler state."""
        self.model.load_state_dict(state["model"])  # the stage's layers are the whole model's
        opt = state["optimizer"]["pipeline_stages"][stage_rank]
        sched = state["lr_scheduler"]["pipeline_stages"][stage_rank]
        self.stage.optimizer.load_state_dict(opt)
        if self.stage.scheduler is not None and sched is not None:
            self.stage.scheduler.load_state_dict(sched)
        replica = self.stage.replica_of_successor
        if replica is not None:  # its weights came with the whole model (the same layer objects)
            succ = replica.stage_rank
            replica.optimizer.load_state_dict(state["optimizer"]["pipeline_stages"][succ])
            if replica.scheduler is not None and state["lr_scheduler"]["pipeline_stages"][succ] is not None:
                replica.scheduler.load_state_dict(state["lr_scheduler"]["pipeline_stages"][succ])

    def load_stage_state(self, state: dict[str, Any]) -> None:
        s = self.stage
        s.model.load_state_dict(state["model"])
        s.optimizer.load_state_dict(state["optimizer"])
        if s.scheduler is not None and state.get("lr_scheduler") is not None:
            s.scheduler.load_state_dict(state["lr_scheduler"])
        if state.get("prev_version") is not None:
            s.load_prev_version(state["prev_version"])

    def transfer(self, group: Group, steps: list[int], target: int) -> int:
        """Bring every worker to step ``target``: each stage's state goes from a member of that
        stage that reached it to the members of that stage behind. ``steps[r]`` is rank ``r``'s
        step. Collective. Raises when no member of some stage reached ``target`` (a stage applied
        a step another stage lost: the pipeline cannot be made consistent)."""
        if self._relaid == group.generation:
            return 0  # the re-layout moved every stage a member needed
        if self._settled is not None and self._settled[0] == group.generation:
            steps = self._settled[1]  # members that finished the interrupted step need nothing
        p = self.pipeline.stages
        moved = 0
        for s in range(p):
            ranks = [r for r in range(len(steps)) if r % p == s]
            ahead = [r for r in ranks if steps[r] == target]
            receivers = [r for r in ranks if steps[r] < target]
            if not ahead:
                raise RuntimeError(
                    f"no worker of stage {s} holds step {target} (stage steps {[steps[r] for r in ranks]}): a "
                    f"failure struck between the stages' updates of one step; the pipelined job cannot continue "
                    f"consistently (resume from a checkpoint)"
                )
            stage_src = ahead[0]
            if not receivers:
                continue
            mine = self.stage_state() if group.rank == stage_src else None
            state, n = broadcast_state(group, stage_src, mine, self.device, receivers=receivers)
            moved += n
            if group.rank in receivers:
                self.load_stage_state(state)
        if self.pipeline.redundancy:
            # Workers behind also hold a stale replica of their successor's stage: it comes from a
            # member of that stage that reached the step.
            for s in range(p):
                succ = (s + 1) % p
                receivers = [r for r in range(len(steps)) if r % p == s and steps[r] < target]
                if not receivers:
                    continue
                src = next(r for r in range(len(steps)) if r % p == succ and steps[r] == target)
                mine = self.stage_state() if group.rank == src else None
                state, n = broadcast_state(group, src, mine, self.device, receivers=receivers)
                moved += n
                if group.rank in receivers:
                    self.stage.replica_of_successor.load(state)
        return moved

    def gather_state(self, group: Group) -> dict[str, Any] | None:
        """Collective: rank 0 gets the whole model's state (also loaded into ``self.model``, rebuilt
        from the job if needed) and every stage's
        optimizer and scheduler state; others get ``None``. After a failover, members running
        several stages send each stage's state apart, so the layout is that of the job's stages."""
        p = self.pipeline.stages
        if self.layout is not None:
            from virtualflow.plan.pipeline.failover import split_replicas

            n = len(split_replicas(self.layout, p)[0])  # the first replica's members: ranks 0 .. n-1
            per_stage: dict[int, dict[str, Any]] = {}
            for r in range(n):
                if group.rank not in (0, r):
                    continue
                mine = self._stage_states(self.stage, self.layout[r]) if group.rank == r else None
                got = mine if r == 0 else broadcast_state(group, r, mine, self.device, receivers=[0])[0]
                if group.rank == 0:
                    per_stage.update({int(k): v for k, v in got.items()})
            if group.rank != 0:
                return None
            stages = [per_stage[s] for s in range(p)]
        else:
            stages = [self.stage_state() if group.rank == 0 else None]
        for s in range(1, p if self.layout is None else 1):
            if group.rank not in (0, s):
                continue
            state, _ = broadcast_state(group, s, self.stage_state() if group.rank == s else None, self.device,
                                       receivers=[0])
            if group.rank == 0:
                stages.append(state)
        if group.rank != 0:
            return None
        whole = {}
        for st in stages:
            whole.update(st["model"])
        if self.model is None:  # the whole model again, for evaluation (Job.evaluate takes a model)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(self.job.seed)
                self.model = self.job.model().to(self.device)
        self.model.load_state_dict(whole)
        return {"model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "optimizer": {"pipeline_stages": [st["optimizer"] for st in stages]},
                "lr_scheduler": {"pipeline_stages": [st["lr_scheduler"] for st in stages]},
                "pipeline": {"stages": p, "bounds": [list(b) for b in self.full_bounds],
                             "schedule": self.pipeline.schedule}}


def _successor(flat: Any, stages: int, r: int) -> int:
    """Flat index of the successor of member ``r`` in its own pipeline replica (a flat layout:
    one run per member, replicas one after another, each starting at the run holding stage 0)."""
    start = r
    while flat[start][0] != 0:
        start -= 1
    end = r + 1
    while end < len(flat) and flat[end][0] != 0:
        end += 1
    return start + (r - start + 1) % (end - start)


def _load_merged(holder: Any, states: list[dict[str, Any]]) -> None:
    """Load the per-stage states of consecutive job stages into one engine or replica whose
    parameters are theirs in order (optimizer states concatenated, one parameter group)."""
    if holder is None:
        return
    state: dict[int, Any] = {}
    group: dict[str, Any] = {}
    offset = 0
    for st in states:
        opt = st["optimizer"]
        for i, v in opt["state"].items():
            state[offset + int(i)] = v
        if opt["param_groups"]:
            group = {k: v for k, v in opt["param_groups"][0].items() if k != "params"}
            offset += len(opt["param_groups"][0]["params"])
    if offset:
        holder.optimizer.load_state_dict({"state": state, "param_groups": [{**group, "params": list(range(offset))}]})
    sched = next((st["lr_scheduler"] for st in states if st["lr_scheduler"] is not None), None)
    if holder.scheduler is not None and sched is not None:
        holder.scheduler.load_state_dict(sched)
