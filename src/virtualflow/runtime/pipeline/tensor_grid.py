"""Tensor-parallel pipeline stages: the D x P x T grid of a job with ``Pipeline(tensor=T)``.

Layout. Generation rank ``r`` is tensor rank ``t = r % T`` of the stage's tensor-parallel group
and *plane rank* ``r // T``; the plane ranks are laid out as in a pipeline without tensor
parallelism (stage-rank ``(r // T) % P`` of replica ``r // (P T)``). So the ``T`` members of a
stage's tensor-parallel group are consecutive ranks, and a replica is ``P T`` consecutive ranks:
the unit a run grows and shrinks by.

Planes. The ``W / T`` workers with the same tensor rank ``t`` form **plane** ``t``: a pipeline of
``D`` replicas of ``P`` stages in which every worker holds tensor shard ``t`` of its stage. Every
plane runs the unchanged pipeline engine on its own group (``gen/<g>/plane<t>``): its point to
point activations and gradients, its per-stage reduction over the ``D`` replicas
(``stage<s>.t<t>``) and its per-step statistics all-reduce. The planes compute the same
activations, losses and statistics (a tensor-parallel block's output and input gradient are
replicated, and replicated parameters get the same gradient on every tensor rank), so nothing
crosses planes outside the blocks. Inside a block the ``T`` workers of a stage talk over their
tensor-parallel group (``gen/<g>/tp<j>``, ``j`` the plane rank) with the ring collectives
(:class:`virtualflow.comm.ring.Collectives`).

State. A stage's state in plane ``t`` is tensor shard ``t`` of every tensor-parallel parameter
(the converter keeps the original parameter names, :func:`virtualflow.parallel.tensor_parallel_layer`)
and the whole of every replicated one; optimizer state tensors of a parameter's shape are cut the
same way. :func:`merge_stage_states` puts the planes' states together into the single-worker
layout (checkpoints, the final state, evaluation) and :func:`shard_stage_state` cuts it again (a
resume). A newcomer of plane ``t`` receives its stage's state from a member of plane ``t``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from virtualflow.comm.groups import Group
from virtualflow.comm.ring import Collectives

__all__ = ["TensorPlanes", "convert_layers", "merge_stage_states", "rebind_comm", "shard_stage_state",
           "whole_splits"]


class TensorPlanes:
    """One generation's plane group and tensor-parallel group of this worker (collective to build:
    every member of the generation builds its plane, then its tensor-parallel group, in that order,
    so building cannot deadlock)."""

    def __init__(self, group: Group, tensor: int, subgroup: Callable[..., Group]) -> None:
        """``subgroup(generation, name, rank, size, duplex=False)``: a named group of the generation
        (a plane's hops travel both ways at once: ``duplex=True``, a connection per direction)."""
        if group.size % tensor:
            raise RuntimeError(f"a generation of {group.size} workers is not a multiple of tensor={tensor}")
        self.tensor = tensor
        self.t = group.rank % tensor
        self.plane_rank = group.rank // tensor
        self.generation_group = group
        self.plane = subgroup(group.generation, f"plane{self.t}", self.plane_rank, group.size // tensor,
                              duplex=True)
        self.tp = subgroup(group.generation, f"tp{self.plane_rank}", self.t, tensor)
        for g in (self.plane, self.tp):
            g.abort_check = group.abort_check
        self.comm = Collectives(self.tp)

    def plane_steps(self, steps: Sequence[int]) -> list[int]:
        """The generation's per-rank steps, of this plane's members in plane-rank order."""
        return list(steps[self.t::self.tensor])

    def close(self) -> None:
        try:
            self.comm.close(timeout_s=1.0)
        except Exception:  # noqa: BLE001 - a broken generation's collectives may be failed already
            pass
        for g in (self.tp, self.plane):
            if g.pg is not None:
                g.close()


def convert_layers(layers: list[nn.Module], lo: int, hi: int, comm: Any, chunks: int = 1) -> list[nn.Module]:
    """``layers`` with ``[lo, hi)`` replaced by their tensor-parallel forms (this rank's shards)."""
    from virtualflow.parallel.convert import tensor_parallel_layer

    out = list(layers)
    for i in range(lo, hi):
        out[i] = tensor_parallel_layer(layers[i], comm, chunks=chunks)
    return out


def rebind_comm(module: nn.Module, comm: Any) -> None:
    """Point every tensor-parallel block in ``module`` at ``comm`` (a new generation's group).
    A compiled stage recompiles nothing: the blocks read their communicator only inside the calls
    dynamo leaves opaque (:mod:`virtualflow.parallel.sublayers`), so no guard names it."""
    for m in module.modules():
        if m is not module and hasattr(m, "comm") and hasattr(m.comm, "all_reduce"):
            m.comm = comm
    if hasattr(module, "comm") and hasattr(module.comm, "all_reduce"):
        module.comm = comm


def whole_splits(layers: Sequence[nn.Module], tensor: int) -> dict[str, Any]:
    """Per whole-model state key (``"<layer>.<name>"``), how it is cut over ``tensor`` ranks."""
    from virtualflow.parallel.convert import tensor_splits

    out: dict[str, Any] = {}
    for i, layer in enumerate(layers):
        for name, split in tensor_splits(layer, tensor).items():
            out[f"{i}.{name}"] = split
    return out


def _param_names(state: dict[str, Any]) -> list[str]:
    names = state.get("param_names")
    if names is None:
        raise RuntimeError("a tensor-parallel stage state carries its parameter names (param_names); this one does not")
    return list(names)


def merge_stage_states(planes: Sequence[dict[str, Any]], splits: dict[str, Any]) -> dict[str, Any]:
    """One stage's state put together from its ``T`` planes' states (plane order), in the layout of
    the stage without tensor parallelism: model tensors and optimizer state tensors of a
    parameter's shape merged by the parameter's split, everything else (scalars such as Adam's
    ``step``, hyperparameters, scheduler and scaler state) taken from plane 0."""
    first = planes[0]
    model = {}
    for key, value in first["model"].items():
        split = splits.get(key)
        model[key] = value if split is None else split.merge([p["model"][key] for p in planes])
    names = _param_names(first)
    opt = first["optimizer"]
    state: dict[int, Any] = {}
    for idx, entry in opt["state"].items():
        split = splits.get(names[int(idx)])
        shard_shape = first["model"][names[int(idx)]].shape if names[int(idx)] in first["model"] else None
        merged = {}
        for k, v in entry.items():
            if split is not None and isinstance(v, torch.Tensor) and shard_shape is not None and v.shape == shard_shape:
                merged[k] = split.merge([p["optimizer"]["state"][idx][k] for p in planes])
            else:
                merged[k] = v
        state[idx] = merged
    out = dict(first)
    out["model"] = model
    out["optimizer"] = {**opt, "state": state}
    return out


def shard_stage_state(state: dict[str, Any], param_names: Sequence[str], splits: dict[str, Any], t: int,
                      tensor: int) -> dict[str, Any]:
    """Tensor shard ``t`` of one stage's state in the single-worker layout (``model`` holding at
    least the stage's keys; ``optimizer`` over the stage's parameters in ``param_names`` order)."""
    def cut(key: str, value: Any) -> Any:
        split = splits.get(key)
        return value if split is None or not isinstance(value, torch.Tensor) else split.shard(value, t, tensor)

    model = {k: cut(k, v) for k, v in state["model"].items()}
    opt = state["optimizer"]
    full_shapes = {k: v.shape for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    opt_state: dict[int, Any] = {}
    for idx, entry in opt["state"].items():
        name = param_names[int(idx)]
        opt_state[idx] = {k: (cut(name, v) if isinstance(v, torch.Tensor) and v.shape == full_shapes.get(name) else v)
                          for k, v in entry.items()}
    return {**state, "model": model, "optimizer": {**opt, "state": opt_state}}
