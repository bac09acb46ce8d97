"""Pipeline partitioner: where to cut a layered model into stages. Pure code, no processes.

Input: one ``LayerProfile`` per layer (measured by a profiler on the worker's device), the
``Link`` between consecutive workers and the stage count ``p``. Output: a ``Partition``, the
contiguous split of the layers into ``p`` non-empty stages that minimises the slowest stage's
time (PipeDream's objective: in the steady state of a pipeline every stage runs at the pace of
the slowest one), subject to a per-worker memory limit.

Cost model (what "time" and "memory" of a stage mean here; ``tests/pipeline_reference.py``
restates it independently):

- Stage ``s`` holds layers ``[a, b)``. Its **compute** is ``sum(forward_s + backward_s)`` over
  those layers: the time to run one micro-batch through them and back.
- Its **communication** is that of its *output* boundary, the activation of layer ``b - 1``:
  ``2 * (activation_bytes[b-1] / link.bandwidth_bytes_per_s + link.latency_s)`` -- the activation
  goes forward and its gradient (the same size) comes back. Each boundary is charged once, to the
  stage before it; the last stage has no output boundary and pays none. (Charging the receiving
  side too would double-count a transfer that both ends wait for together.)
- **time(s) = compute(s) + communication(s)**, seconds per micro-batch.
- **memory(s) = optimizer_state_factor * sum(param_bytes) + in_flight[s] * sum(stash_bytes)**:
  weights with their gradients and optimizer state, plus the activations kept for the backward of
  every micro-batch the schedule keeps in flight on that stage. ``in_flight`` defaults to 1F1B's
  ``p - s`` (stage 0 holds ``p`` micro-batches, the last stage one); pass a schedule's
  ``stash_bound`` (:mod:`virtualflow.plan.pipeline.schedules`) for any other schedule or for
  ``m < p``.
- A split is **feasible** when every stage's memory is ``<= memory_limit_bytes``.

Method (exact, ``O(L^2 * p)`` time, ``O(L^2)`` memory for the per-range sums): a dynamic program
over suffixes. ``best[k][i]`` is the smallest bottleneck (slowest stage time) with which layers
``[i, L)`` can be cut into the last ``k`` stages, each feasible; ``best[k][i] = min_j max(time(i, j, stage p-k), best[k-1][j])``. The
optimum is ``T* = best[p][0]``.

Ties are broken deterministically: of all feasible splits whose bottleneck is exactly ``T*``,
the one whose cut positions are lexicographically smallest (each stage ends as early as it can).
The cuts are chosen front to back: stage ``s`` ends at the smallest ``j`` with ``time <= T*``,
memory within the limit and ``best[p-s-1][j] <= T*``. Early stages hold the most micro-batches in
flight under 1F1B, so keeping them short is also the memory-friendly choice.

Stage replication (PipeDream; ``replicate=True, workers=W``): stage ``s`` may run on ``r_s``
workers, data-parallel within the stage (micro-batches dealt round-robin), with
``sum(r_s) <= W``. Then

- **time(s) = (compute + communication) / r_s + allreduce(s)**, where the ring all-reduce of the
  stage's gradients (``G = sum(param_bytes)``) over ``r`` replicas costs
  ``2 (r-1)/r * G / bandwidth + 2 (r-1) * latency`` (0 for ``r = 1``), over the same ``Link``;
- by default the all-reduce is charged once per micro-batch, as in PipeDream (which synchronises
  every minibatch); pass ``micro_batches=m`` for a flush schedule that reduces once per step, and
  it is charged ``allreduce / m`` per micro-batch;
- memory per replica is unchanged (each replica holds all the stage's weights, and
  ``in_flight[s]`` stays a conservative bound on its stash).

The dynamic program gains a worker dimension (``O(L^2 * p * (W-p+1)^2)``: a stage takes 1 to
``W-p+1`` workers, and with ``W = p`` it is the plain program again); ties go to the
lexicographically smallest ``(end_0, r_0, end_1, r_1, ...)``. Without replication every
``r_s = 1``. (virtualflow's runtime replicates *whole* pipelines, ``d`` replicas of every stage; a
split chosen with replication needs an executor that gives stages different replica counts.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

INF = math.inf


class InfeasiblePartition(ValueError):
    """No split of the layers satisfies the memory limit."""


def _check_amount(owner: str, name: str, value: float, *, allow_inf: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and (math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf)):
        ok = False
    if not ok:
        raise ValueError(
            f"{owner}: {name}={value!r} must be a finite number >= 0; re-run the profiler or fix the "
            f"profile that produced it"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerProfile:
    """What one layer costs, per micro-batch, on the worker's device."""

    forward_s: float
    """Seconds for the layer's forward on one micro-batch."""
    backward_s: float
    """Seconds for its whole backward (input and weight gradients) on one micro-batch."""
    activation_bytes: float
    """Bytes of the layer's output activation: what crosses a stage boundary cut after it."""
    param_bytes: float
    """Bytes of the layer's weights alone (gradients and optimizer state are
    ``partition(optimizer_state_factor=...)``'s business)."""
    stash_bytes: float = 0
    """Bytes kept from the forward for the backward of one micro-batch."""
    name: str = ""
    """Label shown in errors and tables (e.g. the module path ``layers.3``)."""

    def __post_init__(self) -> None:
        owner = f"layer {self.name!r}" if self.name else "LayerProfile"
        for field in ("forward_s", "backward_s", "activation_bytes", "param_bytes", "stash_bytes"):
            _check_amount(owner, field, getattr(self, field))


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """The connection between consecutive pipeline workers (one direction)."""

    bandwidth_bytes_per_s: float
    """Sustained bytes per second; ``math.inf`` makes transfers free of size cost."""
    latency_s: float = 0.0
    """Fixed seconds per message."""

    def __post_init__(self) -> None:
        _check_amount("Link", "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, allow_inf=True)
        if self.bandwidth_bytes_per_s == 0:
            raise ValueError("Link: bandwidth_bytes_per_s=0 must be > 0; give the measured link bandwidth")
        _check_amount("Link", "latency_s", self.latency_s)

    def transfer_s(self, nbytes: float) -> float:
        """One message of ``nbytes`` one way."""
        return nbytes / self.bandwidth_bytes_per_s + self.latency_s

    def allreduce_s(self, nbytes: float, replicas: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``replicas`` workers:
        ``2 (r-1)/r * nbytes / bandwidth + 2 (r-1) * latency``."""
        if replicas <= 1:
            return 0.0
        steps = 2 * (replicas - 1)
        return steps / replicas * nbytes / self.bandwidth_bytes_per_s + steps * self.latency_s

    def boundary_s(self, nbytes: float) -> float:
        """A boundary's cost per micro-batch: activation forward plus its gradient back."""
        return 2.0 * self.transfer_s(nbytes)


@dataclass(frozen=True, slots=True)
class Partition:
    """A split of ``L`` layers into ``p`` stages, with its predicted costs."""

    boundaries: tuple[tuple[int, int], ...]
    """Per stage, its layers as a half-open range ``(start, stop)``; contiguous, covering all."""
    stage_compute_s: tuple[float, ...]
    """Per stage: forward + backward seconds per micro-batch."""
    stage_comm_s: tuple[float, ...]
    """Per stage: its output boundary's seconds per micro-batch (0 on the last stage)."""
    stage_time_s: tuple[float, ...]
    """Per stage: ``(compute + comm) / replicas + allreduce``."""
    stage_memory_bytes: tuple[float, ...]
    """Per stage: ``factor * params + in_flight * stash``."""
    in_flight: tuple[int, ...]
    """Per stage: micro-batches whose activations the schedule keeps at once."""
    stage_replicas: tuple[int, ...] = ()
    """Per stage: workers running it (all 1 without replication)."""
    stage_allreduce_s: tuple[float, ...] = ()
    """Per stage: its gradient all-reduce's share per micro-batch (0 for one replica)."""
    memory_limit_bytes: float | None = None
    """The limit the split was chosen under (``None``: none)."""
    layer_names: tuple[str, ...] = ()
    """Layer labels for ``describe`` (may be empty)."""

    @property
    def stages(self) -> int:
        return len(self.boundaries)

    @property
    def cuts(self) -> tuple[int, ...]:
        """The ``p - 1`` layer indices at which a new stage starts."""
        return tuple(start for start, _ in self.boundaries[1:])

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.boundaries)

    @property
    def workers(self) -> int:
        """Workers the split uses: ``sum(stage_replicas)``."""
        return sum(self.stage_replicas)

    @property
    def bottleneck(self) -> int:
        """Index of the slowest stage (the lowest index among equals)."""
        t = self.stage_time_s
        return max(range(len(t)), key=lambda s: (t[s], -s))

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's seconds per micro-batch: the pipeline's pace."""
        return self.stage_time_s[self.bottleneck]

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.stage_memory_bytes)

    def step_time_s(self, micro_batches: int) -> float:
        """Predicted 1F1B (or GPipe) step time for ``m`` micro-batches: ``(m + p - 1) * t_max``.

        Model: every stage runs at the slowest stage's pace ``t_max``; the first micro-batch's
        forward takes ``p - 1`` slots to reach the last stage and its gradient as many to come
        back, i.e. ``p - 1`` forward-plus-backward slots of fill and drain on top of the ``m``
        slots of work (the formula the event simulator reproduces for equal stage times).
        """
        if micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches} must be >= 1 (the VNs per pipeline replica)")
        return (micro_batches + self.stages - 1) * self.bottleneck_s

    def bubble_fraction(self, micro_batches: int) -> float:
        """Idle share of the step under the same model: ``(p - 1) / (m + p - 1)``."""
        if micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches} must be >= 1 (the VNs per pipeline replica)")
        return (self.stages - 1) / (micro_batches + self.stages - 1)

    def describe(self, micro_batches: int | None = None) -> str:
        """A text table for ``virtualflow plan``: one row per stage, then the totals."""
        rows = [("stage", "layers", "n", "replicas", "compute ms", "comm ms", "allreduce ms", "time ms",
                 "memory MiB", "in flight")]
        for s, (start, stop) in enumerate(self.boundaries):
            span = f"{start}-{stop - 1}" if stop - start > 1 else f"{start}"
            if self.layer_names:
                first, last = self.layer_names[start], self.layer_names[stop - 1]
                span += f" ({first}..{last})" if stop - start > 1 else f" ({first})"
            mark = " *" if s == self.bottleneck else ""
            rows.append((
                f"{s}{mark}", span, str(stop - start), str(self.stage_replicas[s]),
                f"{self.stage_compute_s[s] * 1e3:.3f}", f"{self.stage_comm_s[s] * 1e3:.3f}",
                f"{self.stage_allreduce_s[s] * 1e3:.3f}", f"{self.stage_time_s[s] * 1e3:.3f}",
                f"{self.stage_memory_bytes[s] / 2**20:.1f}", str(self.in_flight[s]),
            ))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        limit = "none" if self.memory_limit_bytes is None else f"{self.memory_limit_bytes / 2**20:.1f} MiB"
        lines.append(f"bottleneck: stage {self.bottleneck} (*), {self.bottleneck_s * 1e3:.3f} ms per micro-batch; "
                     f"peak memory {self.peak_memory_bytes / 2**20:.1f} MiB, limit {limit}")
        if micro_batches is not None:
            lines.append(f"1F1B step with m={micro_batches}: {self.step_time_s(micro_batches) * 1e3:.3f} ms "
                         f"= (m + p - 1) x bottleneck, bubble {self.bubble_fraction(micro_batches):.1%}")
        return "\n".join(lines)


# ---- helpers --------------------------------------------------------------------------------


def equal_layer_split(n_layers: int, stages: int) -> tuple[tuple[int, int], ...]:
    """The baseline split: stage sizes differ by at most one layer, the extra layers going to the
    *last* stages (which hold the fewest micro-batches in flight under 1F1B).
    ``equal_layer_split(10, 4) -> ((0, 2), (2, 4), (4, 7), (7, 10))``."""
    _check_counts(n_layers, stages)
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s >= stages - extra else 0)
        out.append((start, start + size))
        start += size
    return tuple(out)


def _check_counts(n_layers: int, stages: int) -> None:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"stages={stages!r} must be an integer >= 1; set --pipeline-stages to 1 or more")
    if n_layers < 1:
        raise ValueError("the model has no layers to partition; give at least one LayerProfile")
    if stages > n_layers:
        raise ValueError(
            f"stages={stages} exceeds the model's {n_layers} layers and every stage needs at least one "
            f"layer; lower --pipeline-stages to at most {n_layers}"
        )


def _resolve_in_flight(stages: int, in_flight: Sequence[int] | None) -> tuple[int, ...]:
    if in_flight is None:
        return tuple(stages - s for s in range(stages))
    values = tuple(in_flight)
    if len(values) != stages:
        raise ValueError(
            f"in_flight has {len(values)} entries for stages={stages}; give one count per stage "
            f"(e.g. the schedule's stash_bound)"
        )
    for s, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"in_flight[{s}]={v!r} must be an integer >= 0 (micro-batches stashed on stage {s})")
    return values


def _check_factor(optimizer_state_factor: float) -> None:
    _check_amount("partition", "optimizer_state_factor", optimizer_state_factor)


class _Tables:
    """Per-range sums for all ``0 <= i < j <= L``, accumulated left to right."""

    def __init__(self, layers: Sequence[LayerProfile], link: Link, factor: float, in_flight: Sequence[int],
                 micro_batches: int):
        n = len(layers)
        self.link = link
        self.micro_batches = micro_batches
        self.n = n
        self.in_flight = in_flight
        self.compute = [[0.0] * (n + 1) for _ in range(n)]
        self.params = [[0.0] * (n + 1) for _ in range(n)]
        self.stash = [[0.0] * (n + 1) for _ in range(n)]
        for i in range(n):
            c = prm = st = 0.0
            for j in range(i + 1, n + 1):
                layer = layers[j - 1]
                c += layer.forward_s + layer.backward_s
                prm += layer.param_bytes
                st += layer.stash_bytes
                self.compute[i][j], self.params[i][j], self.stash[i][j] = c, prm, st
        self.comm = [link.boundary_s(layers[j - 1].activation_bytes) if 0 < j < n else 0.0 for j in range(n + 1)]
        self.factor = factor

    def allreduce(self, i: int, j: int, replicas: int) -> float:
        return self.link.allreduce_s(self.params[i][j], replicas) / self.micro_batches

    def time(self, i: int, j: int, replicas: int = 1) -> float:
        if replicas == 1:
            return self.compute[i][j] + self.comm[j]
        return (self.compute[i][j] + self.comm[j]) / replicas + self.allreduce(i, j, replicas)

    def memory(self, i: int, j: int, stage: int) -> float:
        return self.factor * self.params[i][j] + self.in_flight[stage] * self.stash[i][j]


def _minmax_split(
    n: int, stages: int, workers: int, max_replicas: int, cost: Callable[[int, int, int, int], float],
) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """Minimise ``max_s cost(start_s, stop_s, s, r_s)`` over contiguous splits into non-empty
    stages with ``1 <= r_s <= max_replicas`` and ``sum(r_s) <= workers`` (``cost = INF`` marks a
    stage that is not allowed). Returns the optimum, the cuts and the replica counts, the
    lexicographically smallest ``(end_0, r_0, end_1, r_1, ...)`` among exact ties;
    ``(INF, (), ())`` when nothing is allowed."""
    # best[k][i][w]: layers [i, n) as the last k stages (indices stages-k ..) on at most w workers.
    best = [[[INF] * (workers + 1) for _ in range(n + 1)] for _ in range(stages + 1)]
    best[0][n] = [-INF] * (workers + 1)
    for k in range(1, stages + 1):
        s = stages - k
        for i in range(s, n - k + 1):  # the stages before need i >= s layers; these k need n - i >= k
            row = best[k][i]
            for j in range(i + 1, n - k + 2):
                rest_row = best[k - 1][j]
                for w in range(k, workers - s + 1):  # the s stages before took >= s workers
                    b = row[w]
                    for r in range(1, min(max_replicas, w - k + 1) + 1):
                        rest = rest_row[w - r]
                        if rest >= b:
                            continue
                        v = cost(i, j, s, r)
                        if v < rest:
                            v = rest
                        if v < b:
                            b = v
                    row[w] = b
    opt = best[stages][0][workers]
    if opt == INF:
        return INF, (), ()
    ends, reps, i, w = [], [], 0, workers
    for s in range(stages):
        k = stages - s
        found = False
        for j in range(i + 1, n - k + 2):
            for r in range(1, min(max_replicas, w - k + 1) + 1):
                if best[k - 1][j][w - r] <= opt and cost(i, j, s, r) <= opt:
                    ends.append(j)
                    reps.append(r)
                    i, w, found = j, w - r, True
                    break
            if found:
                break
    return opt, tuple(ends[:-1]), tuple(reps)


def _boundaries(n: int, cuts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    edges = (0, *cuts, n)
    return tuple((edges[s], edges[s + 1]) for s in range(len(edges) - 1))


def _build(layers: Sequence[LayerProfile], bounds: Sequence[tuple[int, int]], tables: _Tables,
           memory_limit_bytes: float | None, replicas: Sequence[int] | None = None) -> Partition:
    reps = tuple(replicas) if replicas is not None else (1,) * len(bounds)
    return Partition(
        boundaries=tuple(bounds),
        stage_compute_s=tuple(tables.compute[a][b] for a, b in bounds),
        stage_comm_s=tuple(tables.comm[b] for _, b in bounds),
        stage_time_s=tuple(tables.time(a, b, r) for (a, b), r in zip(bounds, reps)),
        stage_memory_bytes=tuple(tables.memory(a, b, s) for s, (a, b) in enumerate(bounds)),
        in_flight=tuple(tables.in_flight),
        stage_replicas=reps,
        stage_allreduce_s=tuple(tables.allreduce(a, b, r) for (a, b), r in zip(bounds, reps)),
        memory_limit_bytes=memory_limit_bytes,
        layer_names=tuple(layer.name for layer in layers) if any(layer.name for layer in layers) else (),
    )


def _check_positive_int(name: str, value: object, rule: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1; {rule}")


def _prepare(layers: Sequence[LayerProfile], stages: int, link: Link, in_flight: Sequence[int] | None,
             optimizer_state_factor: float, memory_limit_bytes: float | None,
             micro_batches: int | None) -> _Tables:
    layers = list(layers)
    for idx, layer in enumerate(layers):
        if not isinstance(layer, LayerProfile):
            raise ValueError(f"layers[{idx}] is a {type(layer).__name__}, not a LayerProfile")
    if not isinstance(link, Link):
        raise ValueError(f"link={link!r} must be a Link(bandwidth_bytes_per_s=..., latency_s=...)")
    _check_counts(len(layers), stages)
    _check_factor(optimizer_state_factor)
    if memory_limit_bytes is not None:
        _check_amount("partition", "memory_limit_bytes", memory_limit_bytes)
    if micro_batches is not None:
        _check_positive_int("micro_batches", micro_batches, "give the VNs per pipeline replica per step")
    return _Tables(layers, link, optimizer_state_factor, _resolve_in_flight(stages, in_flight),
                   1 if micro_batches is None else micro_batches)


def evaluate_split(
    layers: Sequence[LayerProfile],
    boundaries: Sequence[tuple[int, int]],
    *,
    link: Link,
    memory_limit_bytes: float | None = None,
    in_flight: Sequence[int] | None = None,
    optimizer_state_factor: float = 4.0,
    replicas: Sequence[int] | None = None,
    micro_batches: int | None = None,
) -> Partition:
    """The costs of a given split (e.g. ``equal_layer_split``) under the same model as
    ``partition``, optionally with ``replicas`` per stage. A split over the memory limit is
    reported, not refused: compare ``peak_memory_bytes`` with the limit."""
    bounds = tuple((int(a), int(b)) for a, b in boundaries)
    tables = _prepare(layers, len(bounds), link, in_flight, optimizer_state_factor, memory_limit_bytes,
                      micro_batches)
    expect = 0
    for s, (a, b) in enumerate(bounds):
        if a != expect or b <= a:
            raise ValueError(
                f"boundaries[{s}]={(a, b)} is not a non-empty range starting at layer {expect}; stages must "
                f"be contiguous, non-empty and cover layers 0..{tables.n - 1} in order"
            )
        expect = b
    if expect != tables.n:
        raise ValueError(f"boundaries end at layer {expect} but the model has {tables.n} layers; cover them all")
    if replicas is not None:
        replicas = tuple(replicas)
        if len(replicas) != len(bounds):
            raise ValueError(f"replicas has {len(replicas)} entries for {len(bounds)} stages; give one per stage")
        for s, r in enumerate(replicas):
            _check_positive_int(f"replicas[{s}]", r, "every stage runs on at least one worker")
    return _build(layers, bounds, tables, memory_limit_bytes, replicas)


def partition(
    layers: Sequence[LayerProfile],
    stages: int,
    *,
    link: Link,
    memory_limit_bytes: float | None = None,
    in_flight: Sequence[int] | None = None,
    optimizer_state_factor: float = 4.0,
    replicate: bool = False,
    workers: int | None = None,
    micro_batches: int | None = None,
) -> Partition:
    """The optimal contiguous split of ``layers`` into ``stages`` non-empty stages.

    Minimises the slowest stage's time under the cost model of this module's docstring, with
    every stage's memory ``<= memory_limit_bytes`` (``None``: no limit). ``in_flight[s]`` is the
    micro-batches stage ``s`` stashes (default 1F1B: ``stages - s``). ``optimizer_state_factor``
    multiplies parameter bytes into resident bytes: 4 for fp32 Adam (weights, gradients, two
    moments), 3 for SGD with momentum, 2 for plain SGD.

    ``replicate=True`` also chooses how many of ``workers`` (``>= stages``) run each stage
    (PipeDream's stage replication); ``micro_batches`` then amortises each stage's gradient
    all-reduce over a step (default: one all-reduce per micro-batch, as PipeDream).

    Raises ``ValueError`` for bad input (more stages than layers, bad profiles, too few workers)
    and ``InfeasiblePartition`` (a ``ValueError``) when no split fits the memory limit, naming the
    smallest peak any split reaches and the stage that holds it.
    """
    tables = _prepare(layers, stages, link, in_flight, optimizer_state_factor, memory_limit_bytes,
                      micro_batches)
    n, limit = tables.n, memory_limit_bytes
    if replicate:
        if workers is None:
            raise ValueError("replicate=True needs workers=...: the workers the stages may share (>= stages)")
        _check_positive_int("workers", workers, "give the workers the pipeline may use")
        if workers < stages:
            raise ValueError(
                f"workers={workers} is fewer than stages={stages} and every stage needs a worker; raise "
                f"--workers to at least {stages} or lower --pipeline-stages"
            )
        max_replicas = workers - stages + 1
    else:
        if workers is not None:
            raise ValueError(
                f"workers={workers} is only used with replicate=True; set replicate=True or drop workers"
            )
        workers, max_replicas = stages, 1

    def time_cost(i: int, j: int, s: int, r: int) -> float:
        if limit is not None and tables.memory(i, j, s) > limit:
            return INF
        return tables.time(i, j, r)

    opt, cuts, reps = _minmax_split(n, stages, workers, max_replicas, time_cost)
    if opt == INF:
        peak, mcuts, _ = _minmax_split(n, stages, stages, 1, lambda i, j, s, r: tables.memory(i, j, s))
        best = _build(layers, _boundaries(n, mcuts), tables, limit)
        s = max(range(stages), key=lambda k: (best.stage_memory_bytes[k], -k))
        a, b = best.boundaries[s]
        raise InfeasiblePartition(
            f"memory_limit_bytes={limit} is below what any split of {n} layers into {stages} stages needs: "
            f"the smallest achievable peak is {peak:.0f} bytes ({peak / 2**20:.1f} MiB), on stage {s} "
            f"(layers {a}-{b - 1}, {best.in_flight[s]} micro-batches in flight); raise memory_limit_bytes to "
            f"at least {math.ceil(peak)}, add pipeline stages (--pipeline-stages), or keep fewer micro-batches "
            f"in flight"
        )
    return _build(layers, _boundaries(n, cuts), tables, limit, reps)
