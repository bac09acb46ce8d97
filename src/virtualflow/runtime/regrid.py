"""A checkpoint's training state cut again for another grid: other stages, another split, or no
pipeline at all (the data-parallel width and the tensor-parallel degree need no cutting: every
checkpoint holds the single-worker layout of the model, and each worker takes its part of it).

Two layouts exist (:mod:`virtualflow.runtime.checkpoint`): an unpipelined state has one optimizer
``state_dict`` (``state["optimizer"]``) indexed by the job optimizer's parameter order; a
pipelined one has one per job stage (``state["optimizer"]["pipeline_stages"][s]``) indexed by that
stage's order, and ``state["pipeline"]`` records its stages and layer bounds (a sharded
checkpoint also each stage's parameter names, ``stage_params``). The model tensors are the same
whole-model ``state_dict`` in both, so only the optimizer and scheduler states are re-cut.

Invariants. Every tensor moves as it is (no copy, no arithmetic): a state re-cut and cut back is
the same state, bit for bit. Parameters are matched by name: a pipelined model's names are
``"<layer index>.<rest>"`` (its ``nn.Sequential``'s), so a name says which stage holds it. A
stage's or the whole job's optimizer order is its parameters' order (the job's optimizer built
on the stage's or the whole model's parameters). Optimizers of several parameter groups are not
re-cut (which group a parameter joins is the job's optimizer's choice): :func:`regrid_refusal`
says so at launch, naming the knobs that resume it as it was written.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["optimizer_names", "regrid_refusal", "restage", "stage_names", "unstage"]


def optimizer_names(optimizer: Any, module: torch.nn.Module) -> list[str]:
    """The names (in ``module``) of the optimizer's parameters in its ``state_dict`` index order
    (parameter group after parameter group)."""
    by_id = {id(q): n for n, q in module.named_parameters()}
    groups = getattr(optimizer, "param_groups", [])
    return [by_id[id(q)] for g in groups for q in g["params"]]


def _layer(name: str) -> int:
    return int(name.split(".", 1)[0])


def _saved_layout(state: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any], dict[str, Any]]:
    """The saved per-stage optimizer and scheduler states and the ``pipeline`` record (an
    unpipelined state: one stage holding every layer)."""
    saved = state.get("pipeline")
    if not isinstance(saved, dict):
        return [state["optimizer"]], [state.get("lr_scheduler")], {"stages": 1}
    return (list(state["optimizer"]["pipeline_stages"]), list(state["lr_scheduler"]["pipeline_stages"]), saved)


def stage_names(state: dict[str, Any], whole_names: Sequence[str]) -> list[list[str]]:
    """Per saved stage, its optimizer's parameter names in index order: as a sharded checkpoint
    records them, else the whole job optimizer's order (``whole_names``) of the layers the stage
    held (the pieces ``k`` with ``k % stages == s`` of the saved bounds); an unpipelined state is
    one stage of every name."""
    saved = _saved_layout(state)[2]
    names = saved.get("stage_params")
    if isinstance(names, list) and names and all(isinstance(n, list) for n in names):
        return [list(n) for n in names]
    bounds, p = saved.get("bounds"), int(saved["stages"])
    if not bounds:
        return [list(whole_names)]
    return [[n for n in whole_names if any(a <= _layer(n) < b for k, (a, b) in enumerate(bounds) if k % p == s)]
            for s in range(p)]


def _by_name(state: dict[str, Any], whole_names: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Every parameter's optimizer state by name, the hyperparameters of the (one) parameter
    group, and the first stage's scheduler state (the stages share one schedule)."""
    opts, scheds, _ = _saved_layout(state)
    names = stage_names(state, whole_names)
    if len(names) != len(opts):
        raise ValueError(f"the checkpoint holds {len(opts)} stage optimizer states but names the parameters of "
                         f"{len(names)} stages; resume it on the grid that wrote it")
    refusal = regrid_refusal(state)
    if refusal is not None:
        raise ValueError(refusal)
    out: dict[str, Any] = {}
    for opt, stage in zip(opts, names):
        for pos, name in enumerate(stage):
            if pos in opt["state"]:
                out[name] = opt["state"][pos]
    group = next(({k: v for k, v in g.items() if k != "params"} for opt in opts for g in opt["param_groups"][:1]), {})
    return out, group, scheds[0]


def regrid_refusal(state: dict[str, Any]) -> str | None:
    """Why ``state`` cannot be cut for another grid (one line naming the knobs that resume it as
    it was written), or ``None``. Reads only the optimizers' ``param_groups`` (so a sharded
    checkpoint's ``meta.pt``, whose ``optimizer`` is its first stage's hyperparameters, will do)."""
    opt = state.get("optimizer") or {}
    opts = opt.get("pipeline_stages", [opt])
    if all(len(o.get("param_groups") or []) <= 1 for o in opts if isinstance(o, dict)):
        return None
    saved = state.get("pipeline")
    saved = saved if isinstance(saved, dict) else {}
    if saved.get("bounds"):
        counts = ",".join(str(int(b) - int(a)) for a, b in saved["bounds"])
        where = f"--pipeline-stages {saved.get('stages')} --split {counts}"
    else:
        where = "no pipeline"
    return (f"the checkpoint's optimizer has several parameter groups, and which group a parameter joins is the "
            f"job optimizer's choice: it resumes only on the stages and split that wrote it ({where}); any data- or "
            f"tensor-parallel width")


def restage(state: dict[str, Any], whole_names: Sequence[str], full_bounds: Sequence[tuple[int, int]],
            stages: int) -> dict[str, Any]:
    """``state`` (pipelined or not) in the layout of ``stages`` stages of pieces ``full_bounds``
    (piece ``k`` on stage ``k % stages``): each parameter's optimizer state follows it by name,
    every stage gets the saved hyperparameters and scheduler state. ``whole_names``: the job
    optimizer's parameter order on the whole model."""
    by_name, group, sched = _by_name(state, whole_names)
    cut, params = [], []
    for s in range(stages):
        mine = [n for n in whole_names if any(a <= _layer(n) < b for k, (a, b) in enumerate(full_bounds)
                                               if k % stages == s)]
        params.append(mine)
        cut.append({"state": {j: by_name[n] for j, n in enumerate(mine) if n in by_name},
                    "param_groups": [{**group, "params": list(range(len(mine)))}] if mine else []})
    record = {**_saved_layout(state)[2], "stages": stages, "bounds": [[int(a), int(b)] for a, b in full_bounds], "stage_params": params}
    return {**state, "optimizer": {"pipeline_stages": cut}, "lr_scheduler": {"pipeline_stages": [sched] * stages},
            "pipeline": record}


def unstage(state: dict[str, Any], whole_names: Sequence[str]) -> dict[str, Any]:
    """``state`` in the unpipelined layout: one optimizer over ``whole_names`` (the job
    optimizer's order), the first stage's scheduler state. An unpipelined state is returned as it is."""
    if "bounds" not in _saved_layout(state)[2]:
        return state
    by_name, group, sched = _by_name(state, whole_names)
    out = dict(state)
    del out["pipeline"]  # the unpipelined layout
    out["optimizer"] = {"state": {j: by_name[n] for j, n in enumerate(whole_names) if n in by_name},
                        "param_groups": [{**group, "params": list(range(len(whole_names)))}]}
    out["lr_scheduler"] = sched
    return out
