"""The round-based mechanism: turn a policy's allocation X into concrete placements, round by round.

A policy says *what fraction of time* each row (a job, or two jobs sharing GPUs) should spend on
each accelerator type. The mechanism enacts that in rounds of ``round_s`` seconds (default 6
minutes, Gavel's value):

1. **Priorities.** For every row ``r`` and type ``k`` with ``X[r, k] > 0``::

       priority[r, k] = X[r, k] / share[r, k],   share[r, k] = received[r, k] / present[r]

   where ``received`` is the time the row ran on ``k`` and ``present`` the time it has been in
   the allocation, both counted since the allocation was last replaced, starting from a prior
   of one round at the allocation (``received = X * round_s``, ``present = round_s``, so every
   row starts at priority 1). A row that has received less than its share rises, one that has
   received more sinks. The rows of every job are tracked by the job ids they contain.
2. **Greedy fill.** Candidates ``(r, k)`` are visited in descending priority (ties: the row
   already running on ``k`` first, so leases extend; then larger ``X``; then row order). A row
   is scheduled on ``k`` if none of its jobs is scheduled yet and ``k`` has enough free GPUs.
3. **Placement**, as each row is chosen. A row that keeps its type and GPU count keeps its exact
   GPUs if they are still free (*lease extension*: no restart). Any other row is placed
   consolidated, on the fewest servers possible (``ceil(gpus / gpus_per_server)``): one server if
   it fits (the fullest that holds it: best fit), else whole free servers plus one for the rest.
   Newcomers avoid GPUs that lease holders still to be visited hold, when they can. A row with
   enough free GPUs of the type but no consolidated placement waits (``skipped_fragmented``);
   since the highest-priority row always sees an empty cluster, nobody waits forever.
4. **Change costs** (what Gavel's simulator leaves out). A job that was not running with the same
   (type, GPU count, GPUs) in the previous round pays, at the start of this round:

   - ``restart_cost_s`` (default 45 s: save a checkpoint, start processes, load it, warm up) when it
     resumes after a preemption or moves to other GPUs or another type (rigid or elastic);
   - ``resize_cost_s`` (default 1.5 s) when an elastic job only changes its GPU count on the same
     type (virtualflow resizes in place between steps); with ``elastic_resize="restart"`` this
     too costs ``restart_cost_s`` (the checkpoint-restart way of resizing);
   - ``start_cost_s`` (default 0) on its very first start (the same for every policy).

Steps 1-2 above describe ``MechanismConfig.lease_first()`` (the default before issue 17). The
default now takes three of Gavel's round mechanics (chosen on ``bench/gavel_mechanics.py``: the
makespan policy's makespan 6-7 % shorter, the agnostic LAS 15-20 % faster, the aware LAS unchanged
within 0.1 %, with restarts free and at 45 s); ``MechanismConfig.gavel()`` adds spread placement;
docs/cluster.md compares. ``order="per_type"`` fills the types one after another in the cluster's order, each from its own
queue sorted by priority, then carried deficit, then X (priorities then compare within a type:
``share`` is the row's fraction of the type's received time); ``prior="equal"`` starts every row
with the same half round on every type after an allocation change (so the first round goes by
allocation size, not lease holders first); ``carry_deficits=True`` keeps each row's owed-minus-
received time across allocation changes as the tie-breaker; ``placement="spread"`` runs a row on
any free GPUs of the type when no consolidated placement exists (no slowdown is charged for it,
as in Gavel's simulator).

**Event-driven reallocation** (``reallocate_on_events=True``): the caller ends a round early at a
job's arrival or completion and plans the next one at once (``end_round(length_s=...)`` counts the
shortened round); elastic jobs then change GPU count mid-round, each change costing
``resize_cost_s`` in place (``restart_cost_s`` with ``elastic_resize="restart"``).

Invariants: a round never uses more GPUs of a type than exist (or of a server than it holds);
every job runs on one type, whole, on the fewest servers; a job appears in at most one scheduled row. The mechanism is
pure bookkeeping: it has no clock, the caller passes times in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from virtualflow.cluster.model import Cluster
from virtualflow.cluster.policies.base import Allocation

__all__ = ["MechanismConfig", "Placement", "RoundPlan", "RoundMechanism"]

_EPS = 1e-9


@dataclass(kw_only=True, slots=True)
class MechanismConfig:
    """Knobs of the round-based mechanism."""

    round_s: float = 360.0
    """Length of a round (seconds)."""
    restart_cost_s: float = 45.0
    """Time lost when a job resumes after a preemption or moves (checkpoint, restart, reload)."""
    resize_cost_s: float = 1.5
    """Time lost when an elastic job changes its GPU count in place."""
    start_cost_s: float = 0.0
    """Time lost on a job's first start."""
    elastic_resize: str = "in_place"
    """``"in_place"`` (virtualflow) or ``"restart"`` (resizing by checkpoint-restart)."""
    order: str = "per_type"
    """``"per_type"`` (default since issue 17, Gavel's round mechanism): the types are filled one after
    another in the cluster's order (list the fastest first, as in the usual ``v100,p100,k80``), each
    from its own queue; ``"global"``: one queue of (row, type) candidates by priority."""
    prior: str = "equal"
    """Counters after an allocation change: ``"equal"`` (default since issue 17, Gavel's) gives every
    row the same half round on every type, so the first round after a change goes by allocation size;
    ``"allocation"`` starts every row at exactly its share (priority 1 everywhere, lease holders first)."""
    carry_deficits: bool = True
    """Keep, across allocation changes, each job's deficit (time it should have received minus time
    it received) and use it to break priority ties (default since issue 17, Gavel's)."""
    placement: str = "consolidated"
    """``"consolidated"``: a job runs only on the fewest servers it needs (it waits otherwise);
    ``"spread"``: consolidated when possible, else on any free GPUs of the type, fewest servers
    first (Gavel's simulator, which also charges no slowdown for it)."""
    reallocate_on_events: bool = False
    """Event-driven reallocation: a round ends early at the first job arrival or completion in it,
    the policy is re-solved at once and a new round starts then, so elastic jobs shrink the moment
    a job arrives and grow back the moment one completes (cheap only when resized in place). Off:
    an arrival waits for the next round boundary and a finished job's GPUs stay idle until then
    (Gavel's). The caller (the simulator, the service) decides when a round ends; the mechanism
    counts each round's actual length (``end_round(length_s=...)``)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.round_s) and self.round_s > 0):
            raise ValueError(f"round_s={self.round_s} must be a positive number of seconds")
        for name in ("restart_cost_s", "resize_cost_s", "start_cost_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v} must be a number of seconds >= 0")
        if self.elastic_resize not in ("in_place", "restart"):
            raise ValueError(f"elastic_resize={self.elastic_resize!r} must be 'in_place' or 'restart'")
        for name, ok in (("order", ("global", "per_type")), ("prior", ("allocation", "equal")),
                         ("placement", ("consolidated", "spread"))):
            if getattr(self, name) not in ok:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {list(ok)}")
        if not isinstance(self.reallocate_on_events, bool):
            raise TypeError(f"reallocate_on_events={self.reallocate_on_events!r} must be True or False")

    @classmethod
    def lease_first(cls, **kw) -> "MechanismConfig":
        """The mechanics before issue 17: one global queue, every row at priority 1 after an allocation
        change (lease holders first), no carried deficits, consolidated placement."""
        return cls(**{"order": "global", "prior": "allocation", "carry_deficits": False, **kw})

    @classmethod
    def gavel(cls, **kw) -> "MechanismConfig":
        """Gavel's round mechanism: per-type queues, equal priors, carried deficits, spread placement."""
        return cls(**{"order": "per_type", "prior": "equal", "carry_deficits": True, "placement": "spread", **kw})


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one job runs this round."""

    acc_type: str
    gpus: int
    servers: tuple[tuple[int, int], ...]
    """(server index within the type, GPUs used on it)."""
    row: tuple[int, ...]
    """The scheduled row (one job id, or a space-sharing pair)."""
    cost_s: float
    """Time lost at the start of the round to a (re)start or resize."""
    change: str
    """``"kept"``, ``"start"``, ``"resume"``, ``"move"``, ``"resize"``."""


@dataclass(slots=True)
class RoundPlan:
    """The decision for one round: job id -> placement (jobs not in it do not run)."""

    placements: dict[int, Placement]
    used: dict[str, int]
    """GPUs used per type."""
    skipped_fragmented: int = 0
    """Rows the greedy fill passed over this round: enough free GPUs of the type, but not on the
    fewest servers the job needs (fragmentation); they run in a later round."""


@dataclass
class _RowStat:
    received: np.ndarray
    present: float


@dataclass
class RoundMechanism:
    """Stateful round scheduler for one cluster (state: the current allocation, the time each row
    received since it was set, and the previous round's placements)."""

    cluster: Cluster
    config: MechanismConfig = field(default_factory=MechanismConfig)

    def __post_init__(self) -> None:
        self._types = list(self.cluster.types)
        self._alloc: Allocation | None = None
        self._elastic: dict[int, bool] = {}
        self._stats: dict[tuple[int, ...], _RowStat] = {}
        self._prev: dict[int, Placement] = {}
        self._ever_ran: set[int] = set()
        self._deficit: dict[tuple[int, ...], np.ndarray] = {}

    # ------------------------------------------------------------------------ allocation

    @property
    def allocation(self) -> Allocation | None:
        return self._alloc

    def set_allocation(self, alloc: Allocation, elastic: dict[int, bool] | None = None) -> None:
        """Replace the allocation (after a policy recomputation); resets the received-time counters.

        ``elastic`` (job id -> bool) says which jobs resize in place; default: none.
        """
        X = np.asarray(alloc.X, dtype=float)
        if X.shape != (len(alloc.rows), len(self._types)):
            raise ValueError(f"allocation X has shape {X.shape}; expected ({len(alloc.rows)}, {len(self._types)}) "
                             f"for cluster types {self._types}")
        for row in alloc.rows:
            g = alloc.gpus[row[0]]
            if g > max(self.cluster.gpus.values()):
                raise ValueError(f"row {row} needs {g} GPUs; the largest type has {max(self.cluster.gpus.values())}")
        if self.config.carry_deficits and self._alloc is not None:
            self._carry_deficits(set(map(tuple, alloc.rows)))
        self._alloc = alloc
        if elastic is not None:
            self._elastic = dict(elastic)
        r = self.config.round_s
        if self.config.prior == "equal":
            self._stats = {tuple(row): _RowStat(received=np.full(len(self._types), r / 2), present=r)
                           for row in alloc.rows}
        else:
            self._stats = {tuple(row): _RowStat(received=X[i] * r, present=r) for i, row in enumerate(alloc.rows)}

    def _carry_deficits(self, keep: set[tuple[int, ...]]) -> None:
        """Add what each row of the outgoing allocation should have received minus what it did."""
        old = self._alloc
        assert old is not None
        X = np.asarray(old.X, dtype=float)
        for i, row in enumerate(old.rows):
            row = tuple(row)
            st = self._stats[row]
            r = self.config.round_s
            prior = np.full(len(self._types), r / 2) if self.config.prior == "equal" else X[i] * r
            d = X[i] * (st.present - r) - (st.received - prior)
            self._deficit[row] = self._deficit.get(row, 0.0) + d
        for row in [k for k in self._deficit if k not in keep]:
            del self._deficit[row]

    def forget(self, job_id: int) -> None:
        """Drop a finished job's lease and history."""
        self._prev.pop(job_id, None)
        self._ever_ran.discard(job_id)
        self._elastic.pop(job_id, None)

    # ------------------------------------------------------------------------ one round

    def priorities(self) -> np.ndarray:
        """(rows, types) current priorities (0 where X is 0, inf where a positive X got nothing)."""
        alloc = self._alloc
        if alloc is None:
            return np.zeros((0, len(self._types)))
        X = np.asarray(alloc.X, dtype=float)
        rec = np.stack([self._stats[tuple(r)].received for r in alloc.rows]) if alloc.rows else X * 0
        if self.config.order == "per_type":  # share of the type's time (compared within a type only)
            share = rec / np.maximum(rec.sum(axis=0), _EPS)[None, :]
        else:
            pres = np.array([self._stats[tuple(r)].present for r in alloc.rows]) if alloc.rows else np.zeros(0)
            share = rec / np.maximum(pres, _EPS)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            pr = np.where(X > _EPS, np.where(share > _EPS, X / np.maximum(share, _EPS), np.inf), 0.0)
        return pr

    def plan_round(self, active: set[int] | None = None) -> RoundPlan:
        """Choose this round's placements (does not advance the counters: call ``end_round``).

        ``active``: job ids still running (rows naming any other job are skipped).
        """
        alloc = self._alloc
        if alloc is None or not alloc.rows:
            self._prev = {}
            return RoundPlan(placements={}, used={t: 0 for t in self._types})
        X = np.asarray(alloc.X, dtype=float)
        pr = self.priorities()
        nrow, k = X.shape
        g_row = np.array([alloc.gpus[row[0]] for row in alloc.rows], dtype=np.int64)
        tix = {t: i for i, t in enumerate(self._types)}
        # Leases: the servers a job held last round, if it may keep them (same type and GPU count).
        holder = np.zeros((nrow, k), dtype=bool)
        lease: dict[int, tuple[int, tuple[tuple[int, int], ...]]] = {}  # row -> (type index, servers)
        for r, row in enumerate(alloc.rows):
            for j in row:
                p = self._prev.get(j)
                if p is not None and p.gpus == g_row[r] and X[r, tix[p.acc_type]] > _EPS:
                    holder[r, tix[p.acc_type]] = True
                    lease.setdefault(r, (tix[p.acc_type], p.servers))
        free_srv = [self._server_caps(t) for t in self._types]
        # GPUs held by possible lease holders: newcomers avoid them when they can (soft reservation).
        reserved = [np.zeros_like(f) for f in free_srv]
        for c, servers in lease.values():
            for s, n in servers:
                reserved[c][s] += n
        rr, cc = np.nonzero(X > _EPS)
        if self.config.order == "per_type":
            # Visit type by type (cluster order); within a type: priority, deficit, X desc; holder first.
            dfc = np.stack([np.broadcast_to(self._deficit.get(tuple(row), 0.0), (k,)) for row in alloc.rows])
            order = np.lexsort((rr, ~holder[rr, cc], -X[rr, cc], -dfc[rr, cc], -np.round(pr[rr, cc], 12), cc))
        else:
            # Visit: priority desc, holder first, X desc, row index, type index.
            order = np.lexsort((cc, rr, -X[rr, cc], ~holder[rr, cc], -pr[rr, cc]))
        per = [self.cluster.gpus_per_server[t] for t in self._types]
        taken: set[int] = set()
        placed: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
        skipped = 0
        for o in order:
            r, c = int(rr[o]), int(cc[o])
            row = alloc.rows[r]
            if any(j in taken for j in row):
                continue
            if active is not None and any(j not in active for j in row):
                continue
            need = int(g_row[r])
            if free_srv[c].sum() < need:
                continue
            servers = None
            if r in lease and lease[r][0] == c:
                old = lease[r][1]
                for s, n in old:
                    reserved[c][s] -= n
                if all(free_srv[c][s] >= n for s, n in old):
                    servers = old
            if servers is None:
                servers = (_consolidated(np.maximum(free_srv[c] - reserved[c], 0), need, per[c])
                           or _consolidated(free_srv[c], need, per[c]))
            if servers is None and self.config.placement == "spread":
                servers = _spread(free_srv[c], need)
            if servers is None:  # enough GPUs, but not on few enough servers: wait for a later round
                skipped += 1
                continue
            for s, n in servers:
                free_srv[c][s] -= n
            taken.update(row)
            placed.append((r, c, servers))
        return self._commit(placed, g_row, skipped)

    def _commit(self, placed: list[tuple[int, int, tuple[tuple[int, int], ...]]], g_row: np.ndarray,
                skipped: int) -> RoundPlan:
        """Change costs against the previous round; remember this round's placements."""
        alloc = self._alloc
        assert alloc is not None
        cfg = self.config
        placements: dict[int, Placement] = {}
        used = {t: 0 for t in self._types}
        for r, c, servers in placed:
            t = self._types[c]
            row = alloc.rows[r]
            g = int(g_row[r])
            used[t] += g
            for j in row:
                p = self._prev.get(j)
                if p is not None and p.acc_type == t and p.servers == servers and p.gpus == g:
                    change, cost = "kept", 0.0
                elif p is None:
                    if j in self._ever_ran:
                        change, cost = "resume", cfg.restart_cost_s
                    else:
                        change, cost = "start", cfg.start_cost_s
                elif p.acc_type == t and p.gpus != g and self._elastic.get(j, False):
                    change = "resize"
                    cost = cfg.resize_cost_s if cfg.elastic_resize == "in_place" else cfg.restart_cost_s
                else:
                    change, cost = "move", cfg.restart_cost_s
                placements[j] = Placement(acc_type=t, gpus=g, servers=servers, row=tuple(row), cost_s=cost,
                                          change=change)
        for t in self._types:
            if used[t] > self.cluster.gpus[t]:  # cannot happen: placement takes free GPUs only
                raise RuntimeError(f"mechanism bug: {used[t]} GPUs of {t} used, {self.cluster.gpus[t]} exist")
        self._prev = placements
        self._ever_ran.update(placements)
        return RoundPlan(placements=placements, used=used, skipped_fragmented=skipped)

    def _server_caps(self, t: str) -> np.ndarray:
        n, per = self.cluster.gpus[t], self.cluster.gpus_per_server[t]
        caps = np.full(n // per, per, dtype=np.int64)
        if n % per:
            caps = np.append(caps, n % per)
        return caps

    def end_round(self, ran_s: dict[int, float] | None = None, *, length_s: float | None = None) -> None:
        """Count the round just played: each row in the allocation was present for the round; each
        scheduled row received the round on its type (``ran_s`` is unused by the counters on
        purpose: a job that finished early still held its GPUs for the round). ``length_s``: the
        round's actual length when it ended early (event-driven reallocation); default ``round_s``."""
        alloc = self._alloc
        if alloc is None:
            return
        r = self.config.round_s if length_s is None else float(length_s)
        if not (np.isfinite(r) and r >= 0):
            raise ValueError(f"length_s={length_s} must be a round length in seconds >= 0")
        tix = {t: i for i, t in enumerate(self._types)}
        for row in alloc.rows:
            self._stats[tuple(row)].present += r
        seen: set[tuple[int, ...]] = set()
        for p in self._prev.values():
            if p.row in seen:
                continue
            seen.add(p.row)
            st = self._stats.get(p.row)
            if st is not None:
                st.received[tix[p.acc_type]] += r

    def stop(self, job_id: int) -> None:
        """The job no longer runs (finished): its GPUs are free next round and it is not a holder."""
        self.forget(job_id)


def _spread(free: np.ndarray, need: int) -> tuple[tuple[int, int], ...] | None:
    """``need`` GPUs from the servers with the most free GPUs first (fewest servers given what is
    free); None if the type has fewer than ``need`` free."""
    if free.sum() < need:
        return None
    out = []
    for s in np.argsort(-free, kind="stable"):
        if need <= 0:
            break
        n = int(min(free[s], need))
        if n > 0:
            out.append((int(s), n))
            need -= n
    return tuple(sorted(out))


def _consolidated(free: np.ndarray, need: int, per_server: int) -> tuple[tuple[int, int], ...] | None:
    """GPUs for a job of ``need`` on the fewest servers (``ceil(need / per_server)``), given each
    server's ``free`` GPUs; None if that is impossible. A job that fits one server goes to the
    fullest server that holds it (best fit: big holes stay for big jobs); a larger one takes whole
    free servers, then the best-fitting server for the remainder."""
    if need <= per_server:
        fits = np.flatnonzero(free >= need)
        if not fits.size:
            return None
        s = int(fits[np.argmin(free[fits])])
        return ((s, need),)
    whole, rest = divmod(need, per_server)
    full = np.flatnonzero(free >= per_server)
    if full.size < whole:
        return None
    out = [(int(s), per_server) for s in full[:whole]]
    if rest:
        left = free.copy()
        left[full[:whole]] = -1
        fits = np.flatnonzero(left >= rest)
        if not fits.size:
            return None
        s = int(fits[np.argmin(left[fits])])
        out.append((s, rest))
    return tuple(sorted(out))
