"""The Dorylus engine: a driver that schedules every interval's tasks on graph servers and tensor
workers, a parameter server with versioned weights, and the bounded-asynchrony rule.

One epoch of one interval is a fixed list of steps (L convolutions)::

    fetch x -> AV_0 -> GA_0 -> AV_1 -> GA_1 ... GA_{L-1} -> AV_L (logits, loss, backward)
            -> GA_{L-1}^T -> fetch -> AV_{L-1}^T -> ... -> GA_0^T -> fetch -> AV_0^T

AV (apply-vertex) runs on a tensor worker, GA (apply-edge + gather) and fetch on the interval's
graph server. After ``AV_l`` the interval's rows are scattered to every server that reads them;
after ``GA_l^T`` its gradient contributions are scattered to the intervals whose vertices it read.
Intervals advance independently (pipelining: while one interval's AV runs on a tensor worker,
the server gathers another), subject to the rules of :mod:`virtualflow.gnn.staleness`.

Parameter server and weight stashing: an interval pins the latest weight version when it starts
an epoch and runs all its AV tasks, forward and backward, with that version (the backward uses
its forward's weights). Each interval-epoch's gradient is its share of the full-graph gradient.
Updates (``update``):

* ``"round"`` (default): one optimizer step as soon as every interval has handed in a gradient
  since the last step, from the sum of one gradient per interval (in interval order). With
  ``S = 0`` that is exactly one full-graph step per epoch; with ``S >= 1`` the intervals do not
  wait for it (they run ahead on the latest version, up to ``S`` epochs): stale-synchronous.
* ``"interval"``: one optimizer step per interval-epoch, from that interval's gradient alone, as
  it finishes (Dorylus's per-interval updates; ``K x P`` steps per epoch, so the learning rate
  may need lowering). With ``S = 0`` this is not full-graph training.

``pipeline=False`` runs the steps in lockstep (no interval starts step ``s`` before every
interval has finished step ``s - 1``): the baseline for the share of latency pipelining hides.

The engine receives its executor (:func:`run_engine`); it never chooses or starts one. The
executors that start processes live in :mod:`virtualflow.backends.gnn`, which also holds the entry
point ``train_dorylus`` (re-exported by :mod:`virtualflow.gnn`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from virtualflow.gnn.executors import Executor
from virtualflow.gnn.job import GNNJob, PreparedGraph, prepare
from virtualflow.gnn.layers import GNNModel, vertex_param_names
from virtualflow.gnn.partition import Plan, partition
from virtualflow.gnn.servers import IntervalPart, ServerPart
from virtualflow.gnn.staleness import StalenessLog, check_staleness, fresh_enough, may_start
from virtualflow.gnn.workers import WorkerLimits

log = logging.getLogger(__name__)

MODES = ("process", "simulated")
UPDATES = ("round", "interval")


@dataclass(kw_only=True, slots=True)
class DorylusOptions:
    graph_servers: int = 1
    """P: graph-server processes, one edge-cut partition each."""
    tensor_workers: int = 2
    """L: stateless tensor workers; 0 = CPU-only (the graph servers do the tensor work)."""
    intervals: int = 2
    """Vertex intervals per graph server: the unit of tensor work, pipelining and staleness."""
    staleness: int = 0
    """S: 0 = synchronous full-graph training; S >= 1 lets intervals run up to S epochs ahead."""
    pipeline: bool = True
    """False: every step in lockstep across intervals (to measure what pipelining hides)."""
    mode: str = "process"
    """"process": real processes; "simulated": the same logic in this process on a virtual clock."""
    order: str = "rcm"
    """Vertex order the partitions are cut from: "rcm" (reverse Cuthill-McKee) or "natural"."""
    limits: WorkerLimits = field(default_factory=WorkerLimits)
    """Emulated cheap-worker limits (latency, bandwidth, cold start, timeouts)."""
    kill_tasks: tuple[int, ...] = ()
    """Fault injection (process mode): these tensor-task dispatches (0-based) lose their worker."""
    sim_duration: Callable[[str, int], float] | str | None = None
    """Simulated mode: seconds a task takes, from ("gs" | "tw", interval); default 1; "measured": the
    time its computation took in this process."""
    timeout_s: float = 600.0
    """Process mode: fail when no process answers for this long."""
    worker_backend: str = "process"
    """Tensor workers as local processes ("process") or Ray tasks ("ray": connects to the Ray cluster
    at ``ray_address``, or starts a local one)."""
    ray_address: str | None = None
    """Ray cluster for worker_backend="ray": None (local / RAY_ADDRESS), "auto" or "HOST:PORT"."""
    update: str = "round"
    """"round": a step once every interval has a new gradient (S=0: full-graph); "interval": a step per
    interval-epoch (see the module docstring)."""
    trace: bool = False
    """Keep one record per apply-vertex task (version used, weights checksum) in the result."""

    def __post_init__(self) -> None:
        if not isinstance(self.graph_servers, int) or self.graph_servers < 1:
            raise ValueError(f"graph_servers={self.graph_servers!r} must be an int >= 1; pass --graph-servers P")
        if not isinstance(self.tensor_workers, int) or self.tensor_workers < 0:
            raise ValueError(f"tensor_workers={self.tensor_workers!r} must be an int >= 0 (0 = CPU-only); pass "
                             f"--tensor-workers L")
        if not isinstance(self.intervals, int) or self.intervals < 1:
            raise ValueError(f"intervals={self.intervals!r} must be an int >= 1 per graph server; pass --intervals K")
        check_staleness(self.staleness)
        if self.worker_backend not in ("process", "ray"):
            raise ValueError(f"worker_backend={self.worker_backend!r} must be 'process' or 'ray'; pass --worker-backend")
        if self.update not in UPDATES:
            raise ValueError(f"update={self.update!r} is not an update rule; choose one of {UPDATES}")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not an engine mode; choose one of {MODES}")
        if not self.pipeline and self.staleness:
            raise ValueError(f"pipeline=False runs intervals in lockstep, which contradicts staleness="
                             f"{self.staleness}; use staleness=0 with --no-pipeline")


@dataclass(slots=True)
class GNNResult:
    state_dict: dict[str, Tensor]
    history: list[dict]  # one record per epoch: epoch, time_s (end, since start), loss, *_acc
    accuracy: dict[str, float]  # of the final weights, full-graph forward
    wall_s: float  # training time (process start-up excluded)
    startup_s: float
    servers: int  # graph servers billed
    tensor_workers: int
    tw_busy_s: float
    tw_tasks: int
    relaunches: int
    timeouts: int
    bytes_to_tw: int
    bytes_from_tw: int
    staleness: StalenessLog
    updates: int
    edge_cut: int
    num_intervals: int
    trace: list[dict] = field(default_factory=list)

    @property
    def epoch_s(self) -> float:
        return self.wall_s / max(1, len(self.history))

    def time_to(self, metric: str, target: float) -> float | None:
        """Seconds until an epoch's forward reached ``metric >= target`` (None if never)."""
        for h in self.history:
            if h.get(metric) is not None and h[metric] >= target:
                return h["time_s"]
        return None


class ParameterServer:
    """Versioned weights: version ``v`` is the weights after ``v`` optimizer steps; a version stays
    stored while an interval that pinned it is in its epoch (weight stashing)."""

    def __init__(self, model: GNNModel, optimizer: Callable) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.optimizer = optimizer(model.parameters())
        self.version = 0
        self.snapshots: dict[int, dict[str, Tensor]] = {}
        self.refs: dict[int, int] = {}
        self.max_live = 0

    def pin(self) -> int:
        v = self.version
        if v not in self.snapshots:
            self.snapshots[v] = {n: p.detach().clone() for n, p in self.params.items()}
        self.refs[v] = self.refs.get(v, 0) + 1
        self.max_live = max(self.max_live, len(self.snapshots))
        return v

    def get(self, version: int, names: tuple[str, ...]) -> dict[str, Tensor]:
        snap = self.snapshots[version]
        return {n: snap[n] for n in names}

    def release(self, version: int) -> None:
        self.refs[version] -= 1
        self._collect()

    def step(self, grads: dict[str, Tensor]) -> None:
        for n, p in self.params.items():
            g = grads.get(n)
            p.grad = g.clone() if g is not None else torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self._collect()

    def _collect(self) -> None:
        for v in [v for v, r in self.refs.items() if r == 0 and v != self.version]:
            del self.refs[v]
            self.snapshots.pop(v, None)
        for v in [v for v in self.snapshots if v not in self.refs and v != self.version]:
            del self.snapshots[v]


def build_parts(plan: Plan, pg: PreparedGraph, model: GNNModel) -> tuple[list[ServerPart], dict[int, list[tuple[int, Tensor]]]]:
    """The graph servers' parts, and for each interval where its rows go: ``[(server, rows of own)]``."""
    n = pg.num_nodes
    own_pos = torch.empty(n, dtype=torch.long)
    for iv in plan.intervals:
        own_pos[iv.own] = torch.arange(iv.n_own)
    iv_server = [iv.server for iv in plan.intervals]
    table_vertices = plan.server_vertices  # sorted unique global ids per server
    feed: dict[int, list[tuple[int, Tensor]]] = {}
    feed_pos: list[dict[int, Tensor]] = [{} for _ in range(plan.num_servers)]
    for iv in plan.intervals:
        targets = sorted({iv.server} | {iv_server[j] for j in iv.readers})
        feed[iv.index] = []
        for p in targets:
            tv = table_vertices[p]
            pos = torch.searchsorted(tv, iv.own)
            hit = (pos < tv.numel()) & (tv[pos.clamp(max=tv.numel() - 1)] == iv.own)
            sel = hit.nonzero().flatten()
            feed[iv.index].append((p, sel))
            feed_pos[p][iv.index] = pos[sel]
    parts = []
    for p in range(plan.num_servers):
        tv = table_vertices[p]
        ivs: dict[int, IntervalPart] = {}
        for k in plan.server_intervals[p]:
            iv = plan.intervals[k]
            owner = plan.owner_interval[iv.sources]
            contrib_to = []
            for j in (k,) + iv.in_neighbours:
                sel = (owner == j).nonzero().flatten()
                contrib_to.append((j, sel, own_pos[iv.sources[sel]]))
            ivs[k] = IntervalPart(
                n_own=iv.n_own, src_pos=torch.searchsorted(tv, iv.sources), edge_index=iv.edge_index,
                edge_weight={l: w[iv.edge_ids] for l, w in pg.edge_weights.items()}, x=pg.x[iv.own],
                contrib_to=contrib_to)
        parts.append(ServerPart(server=p, num_rows=int(tv.numel()), intervals=ivs, feed_pos=feed_pos[p],
                                convs=[c for c in model.convs], specs=model.specs, activation=model.activation,
                                interval_server=iv_server))
    return parts, feed


@dataclass(slots=True)
class _IntervalState:
    epoch: int = 0
    step: int = 0
    running: bool = False
    version: int = -1
    carry: Any = None
    grads: dict[str, Tensor] = field(default_factory=dict)


def _add(acc: dict[str, Tensor], grads: dict[str, Tensor]) -> None:
    for n, g in grads.items():
        acc[n] = acc[n] + g if n in acc else g.clone()


class Driver:
    """Runs the step lists of every interval under the staleness rule (see the module docstring)."""

    def __init__(self, job: GNNJob, opts: DorylusOptions, pg: PreparedGraph, plan: Plan, model: GNNModel,
                 executor: Executor, feed: dict[int, list[tuple[int, Tensor]]]) -> None:
        self.job, self.opts, self.pg, self.plan, self.ex, self.feed = job, opts, pg, plan, executor, feed
        self.ps = ParameterServer(model, job.optimizer)
        self.specs = model.specs
        L = len(self.specs)
        has_bias = [c.bias is not None for c in model.convs]
        self.names = [vertex_param_names(self.specs, has_bias, l) for l in range(L + 1)]
        self.steps: list[tuple[str, int]] = [("fetch", 0)]
        for l in range(L):
            self.steps += [("av", l), ("ga", l)]
        self.steps.append(("last", L))
        for l in reversed(range(L)):
            self.steps += [("ga_t", l), ("fetch_t", l), ("av_t", l)]
        n_iv = len(plan.intervals)
        self.state = [_IntervalState() for _ in range(n_iv)]
        self.completed = [0] * n_iv
        self.written_f = [[-1] * n_iv for _ in range(L)]
        self.written_b = [[-1] * n_iv for _ in range(L)]
        self.pending: list[list[dict[str, Tensor]]] = [[] for _ in range(n_iv)]  # gradients not yet applied
        self.epoch_stats: dict[int, dict] = {}
        self.history: list[dict] = []
        self.log = StalenessLog()
        self.trace: list[dict] = []
        self.total_train = int(pg.masks["train_mask"].sum())
        self.iv_masks = [{m: v[iv.own] for m, v in pg.masks.items()} for iv in plan.intervals]
        self.iv_y = [pg.y[iv.own] for iv in plan.intervals]

    # ---- readiness -----------------------------------------------------------------------

    def _ready(self, i: int) -> bool:
        st = self.state[i]
        if st.running or st.epoch >= self.job.epochs:
            return False
        kind, l = self.steps[st.step]
        if not self.opts.pipeline:
            for o in self.state:
                if o.epoch < self.job.epochs and (o.epoch, o.step) < (st.epoch, st.step):
                    return False
        S, e, iv = self.opts.staleness, st.epoch, self.plan.intervals[i]
        if kind == "fetch" and st.step == 0:
            return may_start(e, self.completed, S)
        if kind == "ga":
            return all(fresh_enough(self.written_f[l][k], e, S) for k in iv.in_neighbours)
        if kind == "fetch_t":
            return all(fresh_enough(self.written_b[l][j], e, S) for j in iv.readers)
        return True

    # ---- dispatch ------------------------------------------------------------------------

    def _params(self, st: _IntervalState, l: int) -> dict[str, Tensor]:
        return self.ps.get(st.version, self.names[l])

    def _record(self, op: str, i: int, st: _IntervalState, l: int, params: dict[str, Tensor]) -> None:
        if self.opts.trace:
            self.trace.append({"op": op, "interval": i, "epoch": st.epoch, "layer": l, "version": st.version,
                               "latest": self.ps.version,
                               "checksum": [float(p.double().sum()) for p in params.values()]})

    def _dispatch(self, i: int) -> None:
        st = self.state[i]
        iv = self.plan.intervals[i]
        kind, l = self.steps[st.step]
        tag = (i, st.epoch, st.step)
        st.running = True
        p = iv.server
        if kind == "fetch" and st.step == 0:
            self.log.started(st.epoch, self.completed)
            st.version = self.ps.pin()
            self.ex.submit_gs(p, ("fetch", 0, i, st.epoch, False), tag)
        elif kind == "av":
            params = self._params(st, l)
            self._record("forward", i, st, l, params)
            self.ex.submit_tw({"op": "forward", "layer": l, "params": params, "x": st.carry}, tag, p)
        elif kind == "ga":
            for k in iv.in_neighbours:
                self.log.read(st.epoch, self.written_f[l][k])
            self.ex.submit_gs(p, ("gather", l, i, st.epoch), tag)
        elif kind == "last":
            params = self._params(st, l)
            self._record("last", i, st, l, params)
            self.ex.submit_tw({"op": "last", "layer": l, "params": params, "x": st.carry, "y": self.iv_y[i],
                               "train": self.iv_masks[i]["train_mask"], "masks": self.iv_masks[i],
                               "total_train": self.total_train}, tag, p)
        elif kind == "ga_t":
            self.ex.submit_gs(p, ("gather_backward", l, i, st.epoch, st.carry), tag)
        elif kind == "fetch_t":
            for j in iv.readers:
                self.log.read(st.epoch, self.written_b[l][j])
            self.ex.submit_gs(p, ("fetch", l, i, st.epoch, True), tag)
        elif kind == "av_t":
            params = self._params(st, l)
            self._record("backward", i, st, l, params)
            x, g = st.carry
            self.ex.submit_tw({"op": "backward", "layer": l, "params": params, "x": x, "g": g}, tag, p)
        st.carry = None

    # ---- completion ----------------------------------------------------------------------

    def _done(self, tag: tuple[int, int, int], out: Any) -> None:
        i, e, s = tag
        st = self.state[i]
        assert st.running and (st.epoch, st.step) == (e, s), f"reply {tag} out of order"  # internal invariant
        st.running = False
        kind, l = self.steps[s]
        if kind == "fetch":
            st.carry = out[0]
        elif kind == "av":
            rows = out["rows"]
            for p, sel in self.feed[i]:
                self.ex.post_gs(p, ("rows", l, i, e, rows if sel.numel() == rows.size(0) else rows[sel]))
            self.written_f[l][i] = e
        elif kind == "ga":
            st.carry = out
        elif kind == "last":
            _add(st.grads, out["grads"])
            stats = self.epoch_stats.setdefault(e, {"loss": 0.0, "correct": {}})
            stats["loss"] += out["loss"]
            for m, (hit, cnt) in out["correct"].items():
                h0, c0 = stats["correct"].get(m, (0, 0))
                stats["correct"][m] = (h0 + hit, c0 + cnt)
            st.carry = out["grad_x"]
        elif kind == "ga_t":
            for p, items in out.items():
                self.ex.post_gs(p, ("contrib", l, i, e, items))
            self.written_b[l][i] = e
        elif kind == "fetch_t":
            st.carry = (out[0], out[1])
        elif kind == "av_t":
            _add(st.grads, out["grads"])
            st.carry = out["grad_x"]
        st.step += 1
        if st.step == len(self.steps):
            self._finish_epoch(i)

    def _finish_epoch(self, i: int) -> None:
        st = self.state[i]
        e = st.epoch
        grads, st.grads = st.grads, {}
        self.ps.release(st.version)
        if self.opts.update == "interval":
            self.ps.step(grads)
        else:
            self.pending[i].append(grads)
            if all(self.pending):  # one gradient from every interval: one step from their sum
                total: dict[str, Tensor] = {}
                for q in self.pending:
                    _add(total, q.pop(0))
                self.ps.step(total)
        self.completed[i] += 1
        st.epoch += 1
        st.step = 0
        if min(self.completed) == e + 1:  # every interval has finished epoch e
            stats = self.epoch_stats.pop(e)
            rec = {"epoch": e, "time_s": self.ex.now(), "loss": stats["loss"], "version": self.ps.version}
            for m, (hit, cnt) in stats["correct"].items():
                rec[m.replace("_mask", "_acc")] = hit / cnt if cnt else None
            self.history.append(rec)

    def run(self) -> None:
        n = len(self.state)
        while any(st.epoch < self.job.epochs for st in self.state):
            for i in range(n):
                if self._ready(i):
                    self._dispatch(i)
            tag, out = self.ex.wait()
            self._done(tag, out)


@dataclass(slots=True)
class DorylusSetup:
    """What a run is built from, before any executor exists: the model, the prepared graph, its
    partition, the graph servers' parts (what an executor is built from) and where each interval's
    rows go."""

    model: GNNModel
    graph: PreparedGraph
    plan: Plan
    parts: list[ServerPart]
    feed: dict[int, list[tuple[int, Tensor]]]


def set_up(job: GNNJob, opts: DorylusOptions) -> DorylusSetup:
    """Build ``job``'s model, prepare and partition its graph, and cut the graph servers' parts."""
    model = job.build_model()
    pg = prepare(job, model)
    plan = partition(pg.looped, pg.num_nodes, opts.graph_servers, opts.intervals, opts.order)
    parts, feed = build_parts(plan, pg, model)
    return DorylusSetup(model, pg, plan, parts, feed)


def run_engine(job: GNNJob, opts: DorylusOptions, setup: DorylusSetup, executor: Executor,
               started_at: float) -> GNNResult:
    """Train ``job`` on ``executor``, which the caller built from ``setup.parts`` starting at
    ``started_at`` (``time.perf_counter()``; start-up time is counted from it). The executor is
    closed when the run ends, whether it succeeds or not.

    The engine never chooses or starts an executor: the public entry point
    (``virtualflow.gnn.train_dorylus``, :mod:`virtualflow.backends.gnn`) builds the one the options
    ask for."""
    model, pg, plan, ex = setup.model, setup.graph, setup.plan, executor
    startup = time.perf_counter() - started_at
    driver = Driver(job, opts, pg, plan, model, ex, setup.feed)
    try:
        if opts.mode == "process":
            ex.warm_up()  # process start-up (importing torch) is not training time
            startup = time.perf_counter() - started_at
        driver.run()
        wall = ex.now()
    finally:
        ex.close()
    model.eval()
    with torch.no_grad():
        acc = evaluate(model, pg)
    st = ex.stats
    return GNNResult(
        state_dict={k: v.detach().clone() for k, v in model.state_dict().items()}, history=driver.history,
        accuracy=acc, wall_s=wall, startup_s=startup, servers=opts.graph_servers, tensor_workers=opts.tensor_workers,
        tw_busy_s=st.tw_busy_s, tw_tasks=st.tw_tasks, relaunches=st.relaunches, timeouts=st.timeouts,
        bytes_to_tw=st.bytes_to_tw, bytes_from_tw=st.bytes_from_tw, staleness=driver.log, updates=driver.ps.version,
        edge_cut=plan.edge_cut(), num_intervals=len(plan.intervals), trace=driver.trace)


def evaluate(model: GNNModel, pg: PreparedGraph) -> dict[str, float]:
    """Accuracy of ``model`` on each mask: one full-graph PyG forward."""
    pred = model(pg.x, pg.edge_index).argmax(-1)
    return {m.replace("_mask", "_acc"): float((pred[v] == pg.y[v]).float().mean()) for m, v in pg.masks.items()
            if int(v.sum())}
