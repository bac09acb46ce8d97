"""A pipelined job's stage state: what moves between members, and how it is cut and merged.

Functions of a :class:`~virtualflow.runtime.pipeline.StageEngine` (and its replica), used by
:class:`~virtualflow.runtime.pipeline.worker_engine.PipelineWorkerEngine`: a stage's state for a member
behind (:func:`stage_state`, :func:`transfer_stages`), the per-job-stage state a Bamboo failover
moves (:func:`stage_states`, :func:`load_merged`), a checkpoint's per-stage states gathered on
rank 0 (:func:`gather_stages`) and a resume from one (:func:`resume_stage`, after
:func:`virtualflow.runtime.regrid.restage` for a checkpoint of another grid), and a member's share
of a sharded checkpoint (:func:`sharded_parts`; with tensor parallelism :func:`grid_parts`).

Invariants. Collective functions (``transfer_stages``, ``gather_stages``) are entered by every
member at the same point with the same arguments (steps known to all). A per-stage state is
``{"model", "optimizer", "lr_scheduler", "grad_scaler"}`` (plus ``prev_version`` for 2BW; the loss
scaler's state is ``None`` unless ``"16-mixed"``, and the same on every stage), with the optimizer in
``state_dict`` form over one parameter group; the checkpoint's layout (``pipeline_stages`` lists)
is unchanged by this module.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from virtualflow.comm.groups import Group
from virtualflow.config.pipeline import Pipeline
from virtualflow.runtime.checkpoint import shared_names
from virtualflow.runtime.dcp import Piece, grid_pieces, model_pieces, optimizer_pieces
from virtualflow.runtime.pipeline.engine import StageEngine
from virtualflow.runtime.pipeline.redundancy import StageReplica
from virtualflow.runtime.regrid import optimizer_names
from virtualflow.runtime.transfer import broadcast_state

__all__ = ["exchange_for_layout", "gather_stages", "grid_parts", "load_merged", "load_stage_state", "optimizer_names",
           "reorder_optimizer", "resume_stage", "sharded_parts", "stage_state", "stage_states", "successor",
           "transfer_stages", "whole_state"]


def successor(flat: Any, stages: int, r: int) -> int:
    """Flat index of the successor of member ``r`` in its own pipeline replica (a flat layout:
    one run per member, replicas one after another, each starting at the run holding stage 0)."""
    start = r
    while flat[start][0] != 0:
        start -= 1
    end = r + 1
    while end < len(flat) and flat[end][0] != 0:
        end += 1
    return start + (r - start + 1) % (end - start)


def load_merged(holder: Any, states: list[dict[str, Any]]) -> None:
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
    load_scaler(holder, next((st.get("grad_scaler") for st in states if st.get("grad_scaler")), None))


def scaler_state(holder: Any) -> dict[str, Any] | None:
    """The holder's loss scaler state (``torch.amp.GradScaler``'s keys), ``None`` without one (a
    replica's scaler is its holder's: it is not part of the replica's state)."""
    loop = getattr(holder, "loop", None)
    scaler = loop.scaler if loop is not None and not isinstance(holder, StageReplica) else None
    return scaler.state_dict() if scaler is not None else None


def load_scaler(holder: Any, state: dict[str, Any] | None) -> None:
    """Load a stage's ``"grad_scaler"`` state into the holder's scaler (every worker's scaler is the
    same, so any stage's will do); nothing when either is missing."""
    loop = getattr(holder, "loop", None)
    if state and loop is not None and loop.scaler is not None and not isinstance(holder, StageReplica):
        loop.scaler.load_state_dict(state)


def stage_states(holder: Any, stages: tuple[int, ...], full_bounds: list[tuple[int, int]]) -> dict[int, dict[str, Any]]:
    """Per job stage, the state ``holder`` (a StageEngine or StageReplica running ``stages``)
    keeps: its layers' tensors, its parameters' optimizer state (one parameter group), the
    scheduler state. ``full_bounds``: the layer range of each job stage."""
    model_state = holder.model.state_dict()
    opt = holder.optimizer.state_dict()
    if len(opt["param_groups"]) > 1:
        raise RuntimeError("a Bamboo failover moves optimizer state stage by stage and supports optimizers "
                           "with one parameter group; this job's has several")
    params = [name for name, _ in holder.model.named_parameters()]  # the optimizer's order
    sched = holder.scheduler.state_dict() if holder.scheduler is not None else None
    out = {}
    for s in stages:
        a, b = full_bounds[s]
        mine = lambda name: a <= int(name.split(".")[0]) < b  # noqa: E731 - layer index of a name
        idx = [i for i, name in enumerate(params) if mine(name)]
        group = {k: v for k, v in opt["param_groups"][0].items() if k != "params"} if opt["param_groups"] else {}
        out[s] = {
            "model": {k: v.detach().clone() for k, v in model_state.items() if mine(k)},
            "optimizer": {"state": {j: opt["state"][i] for j, i in enumerate(idx) if i in opt["state"]},
                          "param_groups": [{**group, "params": list(range(len(idx)))}] if idx else []},
            "lr_scheduler": sched,
            "grad_scaler": scaler_state(holder),
            "param_names": [params[i] for i in idx],  # (a tensor-parallel stage's shards merge by name)
        }
    return out


def stage_state(s: StageEngine) -> dict[str, Any]:
    """What a member behind receives of its stage: pieces, optimizer, scheduler (2BW: older weights)."""
    state = {"model": s.model.state_dict(), "optimizer": s.optimizer.state_dict(),
             "lr_scheduler": s.scheduler.state_dict() if s.scheduler is not None else None,
             "grad_scaler": scaler_state(s)}
    if s.prev_version is not None:  # 2bw: the older weight version is training state too
        state["prev_version"] = {k: {n: t.detach() for n, t in v.items()} for k, v in s.prev_version.items()}
    return state


def resume_stage(stage: StageEngine, model: torch.nn.Module, state: dict[str, Any], stage_rank: int) -> None:
    """Load a gathered state (``gather_state``'s layout): the whole model, then this stage's
    optimizer and scheduler state."""
    model.load_state_dict(state["model"])  # the stage's layers are the whole model's
    opt = state["optimizer"]["pipeline_stages"][stage_rank]
    sched = state["lr_scheduler"]["pipeline_stages"][stage_rank]
    stage.optimizer.load_state_dict(opt)
    if stage.scheduler is not None and sched is not None:
        stage.scheduler.load_state_dict(sched)
    load_scaler(stage, state.get("grad_scaler"))
    replica = stage.replica_of_successor
    if replica is not None:  # its weights came with the whole model (the same layer objects)
        succ = replica.stage_rank
        replica.optimizer.load_state_dict(state["optimizer"]["pipeline_stages"][succ])
        if replica.scheduler is not None and state["lr_scheduler"]["pipeline_stages"][succ] is not None:
            replica.scheduler.load_state_dict(state["lr_scheduler"]["pipeline_stages"][succ])


def load_stage_state(s: StageEngine, state: dict[str, Any]) -> None:
    """Load :func:`stage_state`'s contents into the stage."""
    s.model.load_state_dict(state["model"])
    s.optimizer.load_state_dict(state["optimizer"])
    if s.scheduler is not None and state.get("lr_scheduler") is not None:
        s.scheduler.load_state_dict(state["lr_scheduler"])
    load_scaler(s, state.get("grad_scaler"))
    if state.get("prev_version") is not None:
        s.load_prev_version(state["prev_version"])


def transfer_stages(stage: StageEngine, pipeline: Pipeline, group: Group, steps: list[int], target: int,
                    device: torch.device, *, state_of: Callable[[StageEngine], dict[str, Any]] = stage_state) -> int:
    """Bring every worker to step ``target``: each stage's state (``state_of(stage)``) goes from a
    member of that stage that reached it to the members of that stage behind. ``steps[r]`` is rank
    ``r``'s step. Collective. Raises when no member of some stage reached ``target`` (a stage applied
    a step another stage lost: the pipeline cannot be made consistent)."""
    p = pipeline.stages
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
        mine = state_of(stage) if group.rank == stage_src else None
        state, n = broadcast_state(group, stage_src, mine, device, receivers=receivers)
        moved += n
        if group.rank in receivers:
            load_stage_state(stage, state)
    if pipeline.redundancy:
        # Workers behind also hold a stale replica of their successor's stage: it comes from a
        # member of that stage that reached the step.
        for s in range(p):
            succ = (s + 1) % p
            receivers = [r for r in range(len(steps)) if r % p == s and steps[r] < target]
            if not receivers:
                continue
            src = next(r for r in range(len(steps)) if r % p == succ and steps[r] == target)
            mine = state_of(stage) if group.rank == src else None
            state, n = broadcast_state(group, src, mine, device, receivers=receivers)
            moved += n
            if group.rank in receivers:
                stage.replica_of_successor.load(state)
    return moved


def gather_stages(stage: StageEngine, pipeline: Pipeline, layout: Any, full_bounds: list[tuple[int, int]],
                  group: Group, device: torch.device, *,
                  state_of: Callable[[StageEngine], dict[str, Any]] = stage_state) -> list[dict[str, Any]] | None:
    """Collective: rank 0 gets every job stage's state (``state_of``'s layout, :func:`stage_state`
    by default, in stage order); others get ``None``. After a failover, members running several stages send each
    stage's state apart, so the layout is that of the job's stages."""
    p = pipeline.stages
    if layout is not None:
        from virtualflow.plan.pipeline.failover import split_replicas

        n = len(split_replicas(layout, p)[0])  # the first replica's members: ranks 0 .. n-1
        per_stage: dict[int, dict[str, Any]] = {}
        for r in range(n):
            if group.rank not in (0, r):
                continue
            mine = stage_states(stage, layout[r], full_bounds) if group.rank == r else None
            got = mine if r == 0 else broadcast_state(group, r, mine, device, receivers=[0])[0]
            if group.rank == 0:
                per_stage.update({int(k): v for k, v in got.items()})
        if group.rank != 0:
            return None
        stages = [per_stage[s] for s in range(p)]
    else:
        stages = [state_of(stage) if group.rank == 0 else None]
    for s in range(1, p if layout is None else 1):
        if group.rank not in (0, s):
            continue
        state, _ = broadcast_state(group, s, state_of(stage) if group.rank == s else None, device,
                                   receivers=[0])
        if group.rank == 0:
            stages.append(state)
    if group.rank != 0:
        return None
    return stages


def whole_state(stages: list[dict[str, Any]], model: torch.nn.Module, pipeline: Pipeline,
                full_bounds: list[tuple[int, int]]) -> dict[str, Any]:
    """The whole training state (a checkpoint's layout) from every job stage's state (in the
    single-worker layout, stage order), the whole model's loaded into ``model``."""
    whole = {}
    for st in stages:
        whole.update(st["model"])
    model.load_state_dict(whole)
    return {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "optimizer": {"pipeline_stages": [st["optimizer"] for st in stages]},
            "lr_scheduler": {"pipeline_stages": [st["lr_scheduler"] for st in stages]},
            "grad_scaler": stages[0].get("grad_scaler"),  # the same on every stage (16-mixed; else None)
            "pipeline": {"stages": pipeline.stages, "bounds": [list(b) for b in full_bounds],
                         "schedule": pipeline.schedule}}


def exchange_for_layout(group: Group, new: list[list[int]], p: int, own_old: tuple[int, ...],
                        rep_old: tuple[int, ...], local: dict[int, dict[str, Any]],
                        device: torch.device) -> tuple[dict[int, dict[str, Any]], int]:
    """Collective, for a Bamboo re-layout to the flat layout ``new`` (one run of job stages per
    member): every member ends up with the per-stage states (:func:`stage_states`) of its own
    stages and of its successor's, taken from what it holds (``local``: the stages it ran,
    ``own_old``, and those its replica held, ``rep_old``) or broadcast from a member that runs
    the stage (else holds its replica). Returns those states and the bytes the re-layout moved
    between all the members."""
    # Who holds what: 2 = runs the stage, 1 = holds its replica.
    held = torch.zeros(group.size, p, dtype=torch.float64)
    for s in rep_old:
        held[group.rank, s] = 1
    for s in own_old:
        held[group.rank, s] = 2
    group.all_reduce(held)
    n = len(new)
    got: dict[int, dict[str, Any]] = {}
    moved = 0
    for r in range(n):
        for s in sorted(set(new[r]) | set(new[successor(new, p, r)])):
            if held[r, s] > 0:
                if r == group.rank:
                    got[s] = local[s]
                continue
            sources = [q for q in range(n) if held[q, s] == 2] or [q for q in range(n) if held[q, s] == 1]
            if not sources:
                raise RuntimeError(f"no worker holds stage {s} (nor its replica): the pipeline cannot go on; "
                                   f"resume from a checkpoint")
            src = sources[0]
            state, nbytes = broadcast_state(group, src, local[s] if group.rank == src else None, device,
                                            receivers=[r])
            if group.rank == src:
                moved += nbytes
            if r == group.rank:
                got[s] = state
    total = torch.tensor([float(moved)], dtype=torch.float64)
    group.all_reduce(total)
    return got, int(total.item())  # every member: the re-layout's bytes in all

def sharded_parts(stage: StageEngine, pipeline: Pipeline, full_bounds: list[tuple[int, int]], rank: int,
                  size: int) -> tuple[list[Piece], dict[str, Any] | None]:
    """Generation rank ``rank``'s part of a sharded checkpoint (standard layout, ``size`` members):
    stage-rank ``s`` of replica ``k`` writes its share (1 / replicas) of its stage's layers and
    optimizer state (entries ``model/<name>``, ``optimizer/stage/<s>/state/<index>/<key>``);
    replica 0's member of each stage also writes the stage's optimizer hyperparameters and
    scheduler state (``meta.pt``), rank 0 with the pipeline's stages and bounds. Local."""
    p = pipeline.stages
    s, k, replicas = rank % p, rank // p, size // p
    model = stage.model.state_dict()
    pieces = model_pieces(model, k, replicas)
    more, rest = optimizer_pieces(stage.optimizer.state_dict(), k, replicas)
    for piece in more:
        piece.fqn = piece.fqn.replace("optimizer/state/", f"optimizer/stage/{s}/state/", 1)
    pieces += more
    if k != 0:
        return pieces, None
    meta = _stage_meta(stage, model, rest, s, [n for n, _ in stage.model.named_parameters()])
    if s == 0:  # the grid that wrote it (a reader needs only the stages and bounds)
        meta["pipeline"] = {"stages": p, "bounds": [list(b) for b in full_bounds], "schedule": pipeline.schedule,
                            "tensor": 1, "replicas": replicas}
    return pieces, meta


def grid_parts(stage: StageEngine, pipeline: Pipeline, full_bounds: list[tuple[int, int]], rank: int, size: int,
               splits: dict[str, Any], names: list[str]) -> tuple[list[Piece], dict[str, Any] | None]:
    """Generation rank ``rank``'s part of a sharded checkpoint of a tensor-parallel job (the
    D x P x T grid of :mod:`.tensor_grid`: tensor rank ``t = rank % T`` of stage ``s`` of replica
    ``k``), written without a gather. A tensor the stage holds whole (a replicated one, Adam's
    ``step``) is written once: an even share of it by each of the stage's ``D T`` workers, as
    entry ``<fqn>``. A tensor the worker holds a shard of (its parameter's :class:`~virtualflow.
    parallel.convert.Split` in ``splits`` is not replicated: the parameter and its optimizer
    tensors of its shape) is entry ``<fqn>@tp<t>`` of the shard's shape, an even share by each of
    the ``D`` workers of tensor rank ``t``. The optimizer state is indexed in the unconverted
    stage's order (``names``), as a gathered checkpoint's is. Replica 0's tensor rank 0 of each
    stage writes the stage's ``meta.pt``; rank 0's also records the grid and every cut tensor's
    split (``pipeline.tensor``, ``replicas``, ``splits``). Local."""
    tensor, p = pipeline.tensor, pipeline.stages
    t, s, k = rank % tensor, (rank // tensor) % p, rank // (tensor * p)
    model = stage.model.state_dict()
    opt = reorder_optimizer(stage.optimizer.state_dict(), optimizer_names(stage.optimizer, stage.model), names)
    cut_names = {n for n in model if not splits[n].replicated}
    whole: list[tuple[str, torch.Tensor]] = []
    cut: list[tuple[str, torch.Tensor]] = []
    for n, v in model.items():
        (cut if n in cut_names else whole).append((f"model/{n}", v))
    rest: dict[int, dict[str, Any]] = {}
    for pos, entry in opt["state"].items():
        name = names[int(pos)]
        for key, v in entry.items():
            if not isinstance(v, torch.Tensor):
                rest.setdefault(int(pos), {})[key] = v
                continue
            holds_cut = name in cut_names and v.shape == model[name].shape
            (cut if holds_cut else whole).append((f"optimizer/stage/{s}/state/{int(pos)}/{key}", v))
    pieces = grid_pieces(whole, cut, t, tensor, k, size // (tensor * p))
    if k or t:
        return pieces, None
    meta = _stage_meta(stage, model, {"param_groups": opt["param_groups"], "state": rest}, s, names)
    if s == 0:
        meta["pipeline"] = {"stages": p, "bounds": [list(b) for b in full_bounds], "schedule": pipeline.schedule,
                            "tensor": tensor, "replicas": size // (tensor * p),
                            "splits": {n: [sp.dim, sp.blocks, sp.units] for n, sp in sorted(splits.items())
                                       if not sp.replicated}}
    return pieces, meta


def _stage_meta(stage: StageEngine, model: dict[str, torch.Tensor], rest: dict[str, Any], s: int,
                names: list[str]) -> dict[str, Any]:
    """A stage's ``meta.pt`` contents: its tensors without elements, its model keys and tied
    names, the optimizer's hyperparameters and non-tensor entries (``rest``), the scheduler and
    loss scaler states, the optimizer's parameter names in index order (``names``)."""
    return {
        "model": {n: v.detach().cpu() for n, v in model.items() if not v.numel()}, "model_keys": list(model),
        "model_aliases": shared_names(model), "optimizer": rest, "stage": s,
        "lr_scheduler": stage.scheduler.state_dict() if stage.scheduler is not None else None,
        "grad_scaler": scaler_state(stage), "param_names": names,
    }


def reorder_optimizer(opt: dict[str, Any], source: list[str], target: list[str]) -> dict[str, Any]:
    """An optimizer ``state_dict`` indexed by parameter names ``source`` re-indexed for ``target``
    (the same names in another order: the optimizer of a converted module and of the original)."""
    if source == target:
        return opt
    if sorted(source) != sorted(target):
        raise RuntimeError(f"optimizer parameters differ between the tensor-parallel stage and the model: "
                           f"{sorted(set(source) ^ set(target))[:4]}")
    index = {n: j for j, n in enumerate(target)}
    state = {index[source[int(i)]]: v for i, v in opt["state"].items()}
    groups = [{**g, "params": [index[source[int(i)]] for i in g["params"]]} for g in opt["param_groups"]]
    return {**opt, "state": state, "param_groups": groups}
