"""Deterministic mode: weights read by two pieces, summed per virtual node before the tree.

Purpose: in the unpipelined deterministic job a weight read by two layers gets, per virtual node
(VN), ONE addition ``g_a + g_b`` inside autograd (the gradients of its two uses meet in the
weight's accumulator), and then the VN's vector joins the fixed VN-id tree. A pipelined job holds
the two layers in two pieces (on one worker, or on two workers that each keep a copy of the
weight), so each piece's backward yields only its own use's gradient. :class:`ExactTies` forms the
same per-VN sum before the tree:

- two pieces on this worker: their per-VN gradients of the weight are added here;
- two workers of a pipeline replica (:class:`~virtualflow.plan.pipeline.geometry.TiedCopy`): the
  worker of the weight's second location sends its per-VN gradients (one message per step, VN
  after VN in micro-batch order) to the *owner* (the worker of its first location, whose backward
  runs last), which adds them to its own per VN and sums the result along the tree over the
  replicas with the rest of its vector; then the owner sends the total back, and both copies take
  the same update.

Invariants:

- Exact: ``a + b == b + a`` bit for bit, so each VN's sum equals autograd's whatever order
  autograd used; the tree then sums the same leaves as the unpipelined job. Only TWO uses are
  exact (:data:`~virtualflow.plan.pipeline.geometry.EXACT_USES`): three or more locations are
  refused at launch, and a location whose layer reads the weight twice is refused on the first
  forward (:meth:`ExactTies.check_uses`).
- Under autocast (``Job.precision`` ``"bf16-mixed"`` / ``"16-mixed"``) the unpipelined job casts
  the weight once per forward and both uses read that one low-precision copy (autocast's cache),
  so their gradients are added in the low precision and cast up once. Where both pieces' uses go
  through such a cast (two ``nn.Linear``, say; not an ``nn.Embedding``, which autocast leaves in
  float32) the per-VN sum is rounded to the low precision and back, which is that addition bit
  for bit (each use's float32 gradient holds a low-precision value exactly, and a low-precision
  addition is a float32 addition rounded once). The first forward of each piece tells whether its
  use is such a cast; the holder sends its answer with its gradients.
- A worker's tree vector holds the gradients of :attr:`ExactTies.tree_params`: every trainable
  parameter it holds except the copies it does not own, in ``params`` order.
- Messages (:func:`~virtualflow.runtime.pipeline.wire.tied_key`) go between the workers of one
  pipeline replica: per step, at most one "parts" message per (holder, owner) and one "total"
  message per (owner, holder). Sends never block; the owner receives the parts after its own
  last backward, the holder receives the total after its own tree exchange, so no cycle exists.

With ``reduction="sharded"`` (each stage replica keeps its chunk of the stage's flat parameter
vector, :mod:`.stage_shard`) the copies' gradients are summed BEFORE the chunks are cut, so a
shared weight is a parameter like any other to the sharded update: deterministic mode forms the
per-VN sum on both workers (:class:`PairedTies`), default mode sums the copies over all workers
before the reduce-scatter (:class:`SumBeforeScatter`; with ``"allreduce"``,
:class:`SumAfterReduction` sums them after the replicas' reduction, as before). Both copies then
hold the same bits in every chunk and take the same elementwise update.
"""

from __future__ import annotations

from typing import Any, Generator, Sequence

import torch

from virtualflow.plan.pipeline.geometry import EXACT_USES, TiedCopy
from virtualflow.runtime.pipeline.reduction import sum_tied
from virtualflow.runtime.pipeline.requests import AllSum, Recv, Request, Send
from virtualflow.runtime.pipeline.wire import tied_key, tied_vn_key

PARTS, TOTAL = 0, 1
"""The two messages of a tied weight: per-VN gradients to the owner, the total from it."""


class ExactTies:
    """Which of a worker's per-piece gradients are summed per VN, sent or received (see the
    module docstring). Built once per worker from its pieces and the job's shared weights."""

    def __init__(self, *, params: Sequence[torch.Tensor], piece_params: dict[int, list[torch.Tensor]],
                 tied: Sequence[TiedCopy], stage_rank: int, p: int, low: torch.dtype | None = None) -> None:
        """``low``: autocast's dtype (``None``: no autocast)."""
        self.stage_rank = stage_rank
        self.p = p
        self.low = low
        # A frozen shared weight has no gradient to sum (its copies stay equal on their own); the
        # workers holding it both see it frozen (every worker builds the same model).
        tied = [t for t in tied if t.param is None or t.param.requires_grad]
        for t in tied:
            if len(t.workers) > EXACT_USES:
                raise ValueError(
                    f"a weight of {t.numel} elements is read by {len(t.workers)} layers on pipeline workers "
                    f"{list(t.workers)}: deterministic mode keeps a shared weight exact only when it is read by "
                    f"{EXACT_USES} layers; untie it, cut the model so its layers are in one piece (Pipeline.split), "
                    f"or train with deterministic=False"
                )
        not_owned = {id(t.param) for t in tied if t.param is not None and t.workers[0] != stage_rank}
        self.tree_params = [q for q in params if id(q) not in not_owned]
        """The parameters whose gradients this worker's tree vector holds, in ``params`` order."""
        where: dict[int, list[tuple[int, int]]] = {}
        for k in sorted(piece_params):
            for j, q in enumerate(piece_params[k]):
                where.setdefault(id(q), []).append((k, j))
        for q in params:
            if len(where[id(q)]) > EXACT_USES:
                raise ValueError(
                    f"a weight of shape {tuple(q.shape)} is read by {len(where[id(q)])} pieces of this pipeline "
                    f"worker: deterministic mode keeps a shared weight exact only when it is read by {EXACT_USES} "
                    f"layers; untie it, cut the model so its layers are in one piece (Pipeline.split), or train "
                    f"with deterministic=False"
                )
        self.shared = {id(q) for q in params if len(where[id(q)]) > 1} | {id(t.param) for t in tied
                                                                            if t.param is not None}
        """Parameters read by more than one piece (here or elsewhere): their uses are checked."""
        # Per owner: this worker's copies whose per-VN gradients go there (tied order): (piece,
        # index in that piece's parameters, the copy).
        self.parts_out: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        # Per holder: the weights this worker owns that it holds a copy of, with their offsets in
        # one VN's block of that holder's parts message; and the per-VN block's size.
        self.parts_in: dict[int, tuple[list[tuple[torch.Tensor, int]], int]] = {}
        for t in tied:
            owner, others = t.workers[0], [w for w in t.workers[1:] if w != t.workers[0]]
            if t.param is not None and stage_rank in others:
                k, j = where[id(t.param)][0]
                self.parts_out.setdefault(owner, []).append((k, j, t.param))
            if stage_rank == owner:
                for w in others:
                    got, size = self.parts_in.get(w, ([], 0))
                    self.parts_in[w] = (got + [(t.param, size)], size + t.numel)
        self.contributions = [where[id(q)] for q in self.tree_params]
        """Per tree parameter, the (piece, index in that piece's parameters) of each local use."""
        self.totals_in = {owner: [t.param for t in tied if t.param is not None and t.workers[0] == owner]
                          for owner in self.parts_out}
        """Per owner: this worker's copies whose total comes from it (tied order)."""
        self.checked: set[int] = set()
        self.cast: dict[tuple[int, int], bool] = {}
        """Per (piece, id(param)) of a shared weight: its use there reads autocast's cast of it."""
        self.remote_cast: dict[int, bool] = {}
        """Per id(param) this worker owns: the holder's use reads autocast's cast (its last message)."""

    @staticmethod
    def needed(params: Sequence[torch.Tensor], piece_params: dict[int, list[torch.Tensor]],
               tied: Sequence[TiedCopy]) -> bool:
        """Does a worker with these pieces share any weight between pieces or with other workers?"""
        seen = [id(q) for k in piece_params for q in piece_params[k]]
        return bool(tied) or len(seen) != len(set(seen))

    # ---- the first forward of each piece --------------------------------------------------------
    def check_uses(self, k: int, params: Sequence[torch.Tensor], roots: Sequence[Any]) -> None:
        """Once per piece: each shared weight of piece ``k`` must be read once by its forward (the
        graph from ``roots``, the piece's outputs); a layer that reads it twice makes three uses in
        all, whose order in autograd cannot be matched. Notes whether that use reads autocast's
        cast of the weight."""
        if k in self.checked:
            return
        self.checked.add(k)
        mine = {id(q): q for q in params if id(q) in self.shared}
        if not mine:
            return
        found = uses_in_graph([r for r in roots if isinstance(r, torch.Tensor)], list(mine.values()))
        for q, (n, cast) in zip(mine.values(), found):
            if n > 1:
                raise ValueError(
                    f"piece {k} reads a shared weight of shape {tuple(q.shape)} {n} times in its forward: with its "
                    f"other use that is {n + 1} uses, and deterministic mode keeps a shared weight exact only with "
                    f"{EXACT_USES} (the order of autograd's additions is not fixed); untie it, cut the model so all "
                    f"its uses are in one piece (Pipeline.split), or train with deterministic=False"
                )
            self.cast[k, id(q)] = cast and self.low is not None

    # ---- streamed: per micro-batch, as its backward ends (.tree_fold) --------------------------------
    def streams(self, schedule: Any) -> bool:
        """Can the per-VN sums be formed as the micro-batches end? Yes unless the schedule splits
        backward (zero-bubble's W): then the holder's W of a micro-batch may come after the
        owner's, and an owner waiting for it could hold up what the holder waits for."""
        return not any(a.kind == "W" for actions in schedule.actions for a in actions)

    def stream_sends(self, k: int, vn: int, index: int, got: dict[int, list[torch.Tensor]],
                     step: int) -> Generator[Request, Any, None]:
        """After piece ``k``'s backward of micro-batch ``index`` (VN ``vn``; ``got``: its gradients
        per piece of this worker so far): to each owner whose copies' pieces have all run it, this
        VN's gradients of those copies (and whether each use read autocast's cast). Sent before
        the piece's input gradient, so an owner's lower piece never waits for them."""
        for owner, entries in self.parts_out.items():
            pieces = {kk for kk, _, _ in entries}
            if k not in pieces or not pieces <= got.keys():
                continue
            chunks = [got[kk][j] for kk, j, _ in entries]
            chunks.append(torch.tensor([float(self.cast.get((kk, id(q)), False)) for kk, _, q in entries],
                                       dtype=chunks[0].dtype, device=chunks[0].device))
            yield Send(owner, tied_vn_key(self.stage_rank, owner, self.p, step, index), [torch.cat(chunks)])

    def stream_receive(self, index: int, step: int) -> Generator[Request, Any, dict[int, torch.Tensor]]:
        """Once this worker's backward of micro-batch ``index`` ended: the holders' gradients of the
        weights this worker owns, for that VN (``{id(param): gradient}``); they were sent when the
        holders' higher pieces ended that micro-batch's backward, before this worker's."""
        out: dict[int, torch.Tensor] = {}
        for holder, (got, size) in self.parts_in.items():
            (flat,) = yield Recv(holder, tied_vn_key(holder, self.stage_rank, self.p, step, index))
            if flat.numel() != size + len(got):
                raise RuntimeError(f"tied-weight gradients from pipeline worker {holder}: {flat.numel()} elements, "
                                   f"expected {size} + {len(got)} flags for micro-batch {index}")
            for (q, off), flag in zip(got, flat[size:].tolist()):
                out[id(q)] = flat[off: off + q.numel()]
                self.remote_cast[id(q)] = flag == 1.0
        return out

    # ---- the step's reduction ---------------------------------------------------------------------
    def send_parts(self, leaves: dict[int, list[tuple[int, list[torch.Tensor]]]], vns: Sequence[int],
                   step: int) -> Generator[Request, Any, None]:
        """To each owner: this worker's per-VN gradients of the copies it owns, VN after VN."""
        for owner, entries in self.parts_out.items():
            chunks = []
            for vn in vns:
                by_piece = dict(leaves[vn])
                chunks += [by_piece[k][j] for k, j, _ in entries]
            like = chunks[0]
            # then, per copy, whether its use read autocast's cast (1) or the weight (0)
            chunks.append(torch.tensor([float(self.cast.get((k, id(q)), False)) for k, _, q in entries],
                                       dtype=like.dtype, device=like.device))
            yield Send(owner, tied_key(self.stage_rank, owner, PARTS, self.p, step), [torch.cat(chunks)])

    def receive_parts(self, vns: Sequence[int], step: int) -> Generator[Request, Any, dict[int, dict[int, torch.Tensor]]]:
        """From each holder: its per-VN gradients of the weights this worker owns; returns
        ``{VN: {id(param): gradient}}``."""
        out: dict[int, dict[int, torch.Tensor]] = {vn: {} for vn in vns}
        for holder, (got, size) in self.parts_in.items():
            (flat,) = yield Recv(holder, tied_key(holder, self.stage_rank, PARTS, self.p, step))
            if flat.numel() != size * len(vns) + len(got):
                raise RuntimeError(f"tied-weight gradients from pipeline worker {holder}: {flat.numel()} elements, "
                                   f"expected {size} per micro-batch x {len(vns)} + {len(got)} flags")
            for i, vn in enumerate(vns):
                for q, off in got:
                    out[vn][id(q)] = flat[i * size + off: i * size + off + q.numel()]
            flags = flat[size * len(vns):].tolist()
            for (q, _), flag in zip(got, flags):
                self.remote_cast[id(q)] = flag == 1.0
        return out

    def leaf_grads(self, by_piece: dict[int, list[torch.Tensor]],
                   remote: dict[int, torch.Tensor] | None) -> list[torch.Tensor]:
        """One VN's gradients of :attr:`tree_params`: each the sum of its two uses where it has
        two (one addition, exact in either order), else its one use's."""
        out = []
        for q, uses in zip(self.tree_params, self.contributions):
            g = by_piece[uses[0][0]][uses[0][1]]
            casts = [self.cast.get((k, id(q)), False) for k, _ in uses]
            for k, j in uses[1:]:
                g = g + by_piece[k][j]
            if remote is not None and id(q) in remote:
                g = g + remote[id(q)]
                casts.append(self.remote_cast.get(id(q), False))
            if len(casts) == EXACT_USES and all(casts):  # autocast's one addition, in its precision
                g = g.to(self.low).to(g.dtype)
            out.append(g)
        return out

    def share_totals(self, step: int) -> Generator[Request, Any, None]:
        """After the tree: each owner sends the summed gradients of its shared weights to their
        other holders, which take them as their copies' gradients."""
        for holder, (got, _) in self.parts_in.items():
            total = torch.cat([q.grad.reshape(-1) for q, _ in got])  # a copy: .grad may change in place later
            yield Send(holder, tied_key(self.stage_rank, holder, TOTAL, self.p, step), [total])
        for owner, copies in self.totals_in.items():
            (flat,) = yield Recv(owner, tied_key(owner, self.stage_rank, TOTAL, self.p, step))
            offset = 0
            for q in copies:
                q.grad = flat[offset: offset + q.numel()].view_as(q).clone()
                offset += q.numel()


def uses_in_graph(roots: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[tuple[int, bool]]:
    """Per parameter of ``params``: how many uses of it the autograd graph behind ``roots`` holds
    (each a gradient autograd adds into the parameter's), and whether its uses all read one cast
    of it (a ``ToCopyBackward0`` node: autocast's cached cast, whose incoming edges are then the
    uses)."""
    want = {id(q): i for i, q in enumerate(params)}
    parents: list[list[Any]] = [[] for _ in params]  # per parameter, the nodes with an edge to it
    indegree: dict[int, int] = {}
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    seen: dict[int, Any] = {}  # id -> node, kept alive so that no id is reused during the walk
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                i = want.get(id(var))
                if i is not None:
                    parents[i].append(fn)
                continue
            indegree[id(nxt)] = indegree.get(id(nxt), 0) + 1
            if id(nxt) not in seen:
                stack.append(nxt)
    out = []
    for nodes in parents:
        casts = [fn for fn in nodes if fn.name() == "ToCopyBackward0"]
        uses = sum(indegree.get(id(fn), 1) for fn in casts) + len(nodes) - len(casts)
        out.append((uses, bool(nodes) and len(casts) == len(nodes)))
    return out


# ---- reduction="sharded": both copies in their workers' tree vectors ------------------------------
class PairedTies(ExactTies):
    """Deterministic mode with ``reduction="sharded"``: the per-VN sums of a weight held by two
    workers are formed on BOTH of them (each sends its per-VN gradients to the other), and each
    copy stays in its worker's tree vector.

    Why not the owner-and-total exchange of :class:`ExactTies`: each replica of a stage keeps only
    its chunk of the stage's flat parameter vector, whose bounds are those of ALL the stage's
    parameters; a tree vector without the holder's copy would not line up with them, and a total
    sent back after the tree would be a whole gradient where the holder keeps a chunk. Here the two
    workers add the same two per-VN gradients (``a + b == b + a`` bit for bit, with the same
    low-precision rounding under autocast: both know both uses' flags), so their leaves are equal,
    the fixed VN-id tree sums them in the same order on both stage groups, and each replica's chunk
    of either copy is the unpipelined job's gradient of that slice. Both copies' chunks take the
    same elementwise update from equal optimizer state, so the copies stay equal; nothing is sent
    after the tree. Messages: one "parts" message per step each way between the two workers of a
    pipeline replica; sends never block, each side receives after its own last backward."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        uses = _piece_uses(kwargs["piece_params"])
        self.tree_params = list(kwargs["params"])
        self.contributions = [uses[id(q)] for q in self.tree_params]
        # Each direction's list: the copies the receiver owns, then those the sender owns (each in
        # tied order); both ends build it the same way. (A worker can own one weight and hold another.)
        owned = {w: [q for q, _ in got] for w, (got, _) in self.parts_in.items()}
        held = {w: [q for _, _, q in entries] for w, entries in self.parts_out.items()}
        for w in owned.keys() | held.keys():
            self.parts_out[w] = [(*uses[id(q)][0], q) for q in held.get(w, []) + owned.get(w, [])]
            copies = owned.get(w, []) + held.get(w, [])
            offsets = [sum(c.numel() for c in copies[:i]) for i in range(len(copies))]
            self.parts_in[w] = (list(zip(copies, offsets)), sum(c.numel() for c in copies))
        self.totals_in = {}

    def streams(self, schedule: Any) -> bool:
        """Never: each side needs the other's gradients of a micro-batch, and the higher piece's
        worker would wait for the lower's backward, which waits for its input gradient."""
        return False

    def share_totals(self, step: int) -> Generator[Request, Any, None]:
        """Nothing after the tree: each copy's own tree gave it the total (see the class)."""
        yield from ()


def _piece_uses(piece_params: dict[int, list[torch.Tensor]]) -> dict[int, list[tuple[int, int]]]:
    """Per id(parameter): the (piece, index in that piece's parameters) of each local use."""
    where: dict[int, list[tuple[int, int]]] = {}
    for k in sorted(piece_params):
        for j, q in enumerate(piece_params[k]):
            where.setdefault(id(q), []).append((k, j))
    return where


EXACT_TIES: dict[str, type[ExactTies]] = {"allreduce": ExactTies, "sharded": PairedTies}
"""Deterministic mode's tied-weight exchange per ``reduction``."""


# ---- deterministic mode: when the per-VN gradients travel (chosen once per step) ---------------------
class NoTies:
    """No weight read by two pieces: nothing travels."""

    streams = True

    def after_backward(self, k: int, vn: int, index: int, got: dict[int, list[torch.Tensor]],
                       step: int) -> Generator[Request, Any, None]:
        yield from ()

    def receive(self, index: int, step: int) -> Generator[Request, Any, dict[int, torch.Tensor]]:
        yield from ()
        return {}

    def at_end(self, leaves: dict[int, list[tuple[int, list[torch.Tensor]]]], vns: Sequence[int],
               step: int) -> Generator[Request, Any, dict[int, dict[int, torch.Tensor]]]:
        yield from ()
        return {}


class StreamedTies(NoTies):
    """Per micro-batch: each VN's gradients of a copy go to the owner as soon as the holder's
    piece ran its backward (:meth:`ExactTies.stream_sends`); the owner takes them when its own
    backward of that micro-batch ended (:meth:`receive`, a streamed step) or at the step's end
    (:meth:`at_end`, a step that sums its leaves then: Bamboo's job stages)."""

    def __init__(self, ties: ExactTies) -> None:
        self.ties = ties

    def after_backward(self, k: int, vn: int, index: int, got: dict[int, list[torch.Tensor]],
                       step: int) -> Generator[Request, Any, None]:
        yield from self.ties.stream_sends(k, vn, index, got, step)

    def receive(self, index: int, step: int) -> Generator[Request, Any, dict[int, torch.Tensor]]:
        return (yield from self.ties.stream_receive(index, step))

    def at_end(self, leaves: dict[int, list[tuple[int, list[torch.Tensor]]]], vns: Sequence[int],
               step: int) -> Generator[Request, Any, dict[int, dict[int, torch.Tensor]]]:
        out = {}
        for index, vn in enumerate(vns):
            out[vn] = yield from self.ties.stream_receive(index, step)
        return out


class StepTies(NoTies):
    """Once per step, after the last backward: all VNs' gradients of a copy in one message
    (:meth:`ExactTies.send_parts`); the step sums its leaves at its end."""

    streams = False

    def __init__(self, ties: ExactTies) -> None:
        self.ties = ties

    def at_end(self, leaves: dict[int, list[tuple[int, list[torch.Tensor]]]], vns: Sequence[int],
               step: int) -> Generator[Request, Any, dict[int, dict[int, torch.Tensor]]]:
        yield from self.ties.send_parts(leaves, vns, step)
        return (yield from self.ties.receive_parts(vns, step))


def tie_traffic(ties: ExactTies | None, schedule: Any) -> NoTies:
    """How a deterministic step's shared weights' per-VN gradients travel (the same choice on
    every worker: it depends on the schedule and the ``reduction`` knob only)."""
    if ties is None:
        return NoTies()
    return StreamedTies(ties) if ties.streams(schedule) else StepTies(ties)


# ---- default mode: the copies' gradients summed over every worker ---------------------------------
class SumAfterReduction:
    """Default mode, ``reduction="allreduce"``: after the replicas' reduction each copy holds its
    use's summed gradient; :func:`~.reduction.sum_tied` adds the copies (replica 0's) and gives
    every copy the total."""

    def __init__(self, tied: Sequence[TiedCopy], device: torch.device) -> None:
        self.tied = list(tied)
        self.device = device

    def before(self, replica: int) -> Generator[Request, Any, None]:
        yield from ()

    def after(self, replica: int) -> Generator[Request, Any, None]:
        yield from sum_tied(self.tied, replica, self.device)


class SumBeforeScatter(SumAfterReduction):
    """Default mode, ``reduction="sharded"``: before the reduce-scatter, every worker's local
    gradients of the shared weights are summed over all workers (every copy, every replica); replica
    0's copies take that total and the other replicas' copies zeros, so the reduce-scatter's sum
    ``total + 0 + ... + 0`` is the total, exactly, in whichever chunk and ring order each stage
    has it. Every copy's chunk thus holds the same bits and takes the same elementwise update (a
    pairwise sum per replica, then the scatter, would add the replicas in each stage's own ring
    order: the copies would drift apart)."""

    def before(self, replica: int) -> Generator[Request, Any, None]:
        parts = [t.param.grad.reshape(-1) if t.param is not None and t.param.grad is not None
                 else torch.zeros(t.numel, dtype=t.dtype, device=self.device) for t in self.tied]
        total = yield AllSum(torch.cat(parts))
        offset = 0
        for t in self.tied:
            if t.param is not None:
                mine = total[offset: offset + t.numel] if replica == 0 else torch.zeros_like(total[:t.numel])
                t.param.grad = mine.view_as(t.param).clone()
            offset += t.numel

    def after(self, replica: int) -> Generator[Request, Any, None]:
        yield from ()


class NoTiedSum:
    """No weight shared with another worker, or deterministic mode (:class:`ExactTies` sums them)."""

    def before(self, replica: int) -> Generator[Request, Any, None]:
        yield from ()

    def after(self, replica: int) -> Generator[Request, Any, None]:
        yield from ()


TIED_SUMS: dict[str, type[SumAfterReduction]] = {"allreduce": SumAfterReduction, "sharded": SumBeforeScatter}
"""Default mode's sum of a shared weight's copies per ``reduction``."""
