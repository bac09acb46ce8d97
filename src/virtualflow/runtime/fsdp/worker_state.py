"""Sharded parameters' side of a VN worker: the model's state when nobody holds it whole.

Purpose: the worker-facing half of the VN engine (:class:`~virtualflow.runtime.vn_worker.VNWorkerEngine`)
reads and writes the model through one *model-state* object chosen when it is built;
:class:`ShardedModelState` is ``reduction="fsdp"``'s (the whole-model one is in ``vn_worker``).
It gives:

* an identical start: rank 0's whole values (held until the first layout is cut) broadcast;
* the model's ``state_dict`` on rank 0 for a checkpoint or the final state, gathered unit by unit
  to rank 0 only (:meth:`~virtualflow.runtime.fsdp.store.ParamStore.gather_to`, which also leaves
  rank 0's model whole for an evaluation until its next step);
* a sharded checkpoint's pieces: every owner writes the parameter ranges and optimizer state it
  holds, with no gather (the reader merges ranges by name, so it resumes on any worker count and
  into an unsharded job);
* a newcomer's state: the small part (buffers, hyperparameters, scheduler, loss scale, progress)
  broadcast as for any job, the shards handed over by their deputies
  (:func:`~virtualflow.runtime.fsdp.reshard.hand_over`);
* a planned change's moves (:meth:`~virtualflow.runtime.fsdp.update.FsdpUpdate.move`).
"""

from __future__ import annotations

from typing import Any

import torch

from virtualflow.comm.groups import Group
from virtualflow.runtime.dcp import Piece
from virtualflow.runtime.transfer import Successor
from virtualflow.runtime.fsdp.update import FsdpUpdate
from virtualflow.runtime.transfer import Progress, broadcast_state

__all__ = ["ShardedModelState"]


class ShardedModelState:
    """The model's state of a VN engine with ``reduction="fsdp"`` (see the module docstring)."""

    def __init__(self, vn: Any) -> None:
        self.vn = vn
        self.update: FsdpUpdate = vn.update
        model = vn.model
        self.names: dict[int, list[str]] = {}
        """Each parameter's names (a tied weight has several; the reader ties them again)."""
        for n, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), []).append(n)

    # -- whole values ---------------------------------------------------------------------------
    def identical_start(self, group: Group) -> None:
        """Every worker starts from rank 0's values (whatever the model's factory does)."""
        store = self.update.store
        assert store.whole is not None
        with torch.no_grad():
            for v in (v for vs in store.whole for v in vs):
                group.broadcast(v, 0)
            for b in self.vn.model.buffers():
                if b.numel():
                    group.broadcast(b.data, 0)

    def model_state(self, group: Group | None) -> dict[str, torch.Tensor] | None:
        """The model's ``state_dict`` on rank 0 (collective; None elsewhere), master dtype, on the
        CPU: views of rank 0's gathered buffers (no second copy of the model), valid until its
        next step, which is after the checkpoint or final state is written; a tied weight is one
        tensor under each of its names."""
        store = self.update.store
        values = store.gather_to(group, 0)
        if values is None:
            return None
        by_id = {}
        for u, whole in zip(store.units, values):
            for p, o, n in zip(u.params, u.offsets, u.numels):
                by_id[id(p)] = whole[o : o + n].view(p.shape).cpu()  # (rank 0's gathered buffers: no copy)
        out = {}
        for k, v in self.vn.model.state_dict(keep_vars=True).items():
            out[k] = by_id[id(v)] if id(v) in by_id else v.detach().cpu()  # a tied weight: one tensor
        return out

    def load(self, state: dict[str, Any]) -> None:
        """A whole state (a checkpoint, ``resume_from``): held until the next layout is cut."""
        vn = self.vn
        self.update.load_model(vn.model, state["model"])
        self.update.load_state(state["optimizer"])
        self._load_rest(state)

    def _load_rest(self, state: dict[str, Any]) -> None:
        vn = self.vn
        if vn.scheduler is not None and state.get("lr_scheduler") is not None:
            vn.scheduler.load_state_dict(state["lr_scheduler"])
        vn.finish.scaling.load_entries(state)

    # -- a newcomer ------------------------------------------------------------------------------
    def small_state(self, progress: Progress) -> dict[str, Any]:
        """What a newcomer receives by broadcast: everything but the shards."""
        vn = self.vn
        return {"buffers": {k: v for k, v in vn.model.named_buffers()},
                "param_groups": vn.optimizer.state_dict()["param_groups"],
                "lr_scheduler": vn.scheduler.state_dict() if vn.scheduler is not None else None,
                "grad_scaler": vn.finish.scaling.state_dict(), "step": progress.step, "control": progress.control}

    def transfer(self, group: Group, src: int, behind: list[int], progress: Progress,
                 on_started: Any = None) -> int:
        """Newcomers (``behind``) get the small state from ``src`` and their shards from their
        deputies; returns the bytes this worker received."""
        mine = self.small_state(progress) if group.rank == src else None
        into = self.small_state(progress) if progress.step < 0 else None
        state, moved = broadcast_state(group, src, mine, self.vn.device, on_started=on_started, receivers=behind,
                                       into=into)
        if group.rank in behind:
            with torch.no_grad():
                for name, b in self.vn.model.named_buffers():
                    b.copy_(state["buffers"][name])
            self.update.load_state({"state": {}, "param_groups": state["param_groups"]})
            self._load_rest(state)
        self.update.take_over(group, behind)
        return moved

    def before_regroup(self, group: Group | None, successor: Successor | None) -> None:
        if group is not None:
            self.update.move(group, successor)

    def before_eval(self, group: Group) -> None:
        """An evaluation on rank 0 follows: the model whole there (collective)."""
        self.update.store.gather_to(group, 0)

    # -- a sharded checkpoint --------------------------------------------------------------------
    def pieces(self, rank: int, size: int) -> tuple[list[Piece], dict[str, Any] | None]:
        """This worker's parameter ranges and optimizer state as checkpoint pieces (no gather),
        and on rank 0 what goes beside them (buffers, names, hyperparameters, scalars)."""
        up = self.update
        out = []
        pos = {i: k for k, i in enumerate(up.order)}
        mine = up.local.state if up.local is not None else {}
        for u, k, start, _, view in up.pieces:
            p = u.params[k]
            out += [Piece(f"model/{n}", tuple(p.shape), start, view.detach().clone()) for n in self.names[id(p)]]
            for key, v in mine.get(view, {}).items():
                fqn = f"optimizer/state/{pos[up.index[id(p)]]}/{key}"
                if v.dim() > 0:
                    out.append(Piece(fqn, tuple(p.shape), start, v.reshape(-1).clone()))
                elif start == 0:  # a scalar (Adam's step) from the owner of the parameter's first element
                    out.append(Piece(fqn, (), 0, v.detach().reshape(-1).clone()))
        if rank != 0:
            return out, None
        model = self.vn.model.state_dict(keep_vars=True)
        buffers = {k: v.detach().cpu() for k, v in model.items() if id(v) not in up.store.unit_of}
        aliases = {k: self.names[id(v)][0] for k, v in model.items() if self.names.get(id(v), [k])[0] != k}
        return out, {"model": buffers, "model_keys": list(model), "model_aliases": aliases,
                     "optimizer": {"state": {}, "param_groups": self.vn.optimizer.state_dict()["param_groups"]}}

    def model_bytes(self) -> int:
        store = self.update.store
        return store.shard_bytes() + sum(b.numel() * b.element_size() for b in self.vn.model.buffers())
