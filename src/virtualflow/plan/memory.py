"""What one worker holds, in bytes, under each data-parallel layout: THE formula of docs/memory.md,
of ``virtualflow plan --grid``'s ``reduction="fsdp"`` and of the launch's host-memory check for
``offload="cpu"``. Pure code: no torch, no processes.

A worker's model piece (the whole model; a pipeline stage's layers; a tensor-parallel stage's
``1/T`` of its blocks) holds ``N`` trainable elements, cut into *units* (``reduction="fsdp"``'s
sharding units; for the other layouts only their sum matters). With ``W`` data-parallel workers
(replicas of that piece), ``S`` optimizer slots per element (:func:`optimizer_slots`: AdamW 2, SGD
with momentum 1) and the bytes of one element of each kind (``p`` parameters, ``g`` gradients,
``s`` optimizer state, ``q`` a gathered parameter, ``r`` a gradient being reduced):

- ``allreduce``: ``N p + N g + S N s`` -- everything whole on every worker;
- ``sharded`` (ZeRO-1/2): ``N p + N g + S ceil(N / W) s`` -- the optimizer state cut in ``W``;
- ``fsdp`` (ZeRO-3): ``sum_u ceil(n_u / W) (p + g + S s)`` -- every unit ``u`` of ``n_u``
  elements cut in ``W``; plus, at the peak of the backward, the units gathered whole: the root
  unit (gathered for the whole forward and backward) and the two largest other units (the one
  whose backward runs and the one prefetched), each with its parameters (``q``) and its unsharded
  gradient (``r``, until the reduce-scatter hands each owner its part). With ``keep_gathered``
  every unit's parameters stay gathered from its forward to its backward: all of them at the
  peak.

Activations are the caller's (they do not depend on the layout): added as they are. With
``offload`` (``fsdp`` only) the sharded terms live in host memory and the device holds the
gathered units and the activations (:attr:`WorkerBytes.host`, :attr:`WorkerBytes.device`).

Invariant: every term is a number of bytes >= 0; ``fsdp`` with ``W = 1`` holds the ``allreduce``
terms plus its gathered units (nothing is cut, a unit is still gathered into its own buffer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["LAYOUTS", "WorkerBytes", "check_host_memory", "optimizer_slots", "worker_bytes"]

LAYOUTS = ("allreduce", "sharded", "fsdp")
"""The data-parallel layouts :func:`worker_bytes` knows (``LaunchOptions.reduction``)."""


@dataclass(frozen=True, slots=True)
class WorkerBytes:
    """One worker's bytes, term by term (the names :meth:`terms` prints)."""

    layout: str
    workers: int
    params: float
    """Parameters held persistently (whole, or this worker's shards)."""
    grads: float
    """Gradients held persistently (whole, or this worker's shards)."""
    optimizer: float
    """Optimizer state (whole, or this worker's part)."""
    gathered_params: float = 0.0
    """``fsdp``: parameters of the units gathered whole at the peak."""
    gathered_grads: float = 0.0
    """``fsdp``: unsharded gradients of those units, before their reduce-scatter."""
    activations: float = 0.0
    """As the caller gave them."""
    offload: bool = False
    """The sharded terms (params, grads, optimizer) live in host memory."""

    @property
    def state(self) -> float:
        """Parameters, gradients and optimizer state: what a step keeps from one step to the next."""
        return self.params + self.grads + self.optimizer

    @property
    def gathered(self) -> float:
        return self.gathered_params + self.gathered_grads

    @property
    def total(self) -> float:
        return self.state + self.gathered + self.activations

    @property
    def host(self) -> float:
        """Bytes kept in host memory (the sharded state with ``offload``; else 0)."""
        return self.state if self.offload else 0.0

    @property
    def device(self) -> float:
        """Bytes on the worker's device: the total less what is offloaded."""
        return self.total - self.host

    def terms(self) -> dict[str, float]:
        """Every term by name, for printing (zero terms of the layout included)."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "gathered_params": self.gathered_params, "gathered_grads": self.gathered_grads,
                "activations": self.activations}

    def describe(self) -> str:
        """One line: ``params 1.0 MiB + grads ... = 3.2 MiB`` (with where each part lives)."""
        parts = [f"{name.replace('_', ' ')} {_mib(v)}" for name, v in self.terms().items()
                 if v or name in ("params", "grads", "optimizer")]
        text = f"{self.layout} (W={self.workers}): " + " + ".join(parts) + f" = {_mib(self.total)}"
        if self.offload:
            text += f" (host {_mib(self.host)}, device {_mib(self.device)})"
        return text


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def _shard(n: int, workers: int) -> int:
    """The largest of ``workers`` near-equal parts of ``n`` elements."""
    return -(-n // workers)


def worker_bytes(layout: str, unit_numels: Sequence[int], optimizer_slots: float, workers: int, *,
                 root_numel: int = 0, param_bytes: int = 4, grad_bytes: int | None = None,
                 state_bytes: int | None = None, gathered_bytes: int | None = None, reduce_bytes: int = 4,
                 keep_gathered: bool = False, offload: bool = False, activations: float = 0.0) -> WorkerBytes:
    """One worker's bytes under ``layout`` (see the module docstring for the formula).

    ``unit_numels``: the elements of each unit (``fsdp``'s sharding units, without the root);
    ``root_numel``: the root unit's (every parameter outside the units; gathered throughout);
    ``optimizer_slots``: state elements per parameter element; ``workers``: the data-parallel
    width ``W``. Element sizes: ``param_bytes`` (the master parameters), ``grad_bytes`` and
    ``state_bytes`` (default: ``param_bytes``), ``gathered_bytes`` (``param_dtype``; default:
    ``param_bytes``) and ``reduce_bytes`` (``reduce_dtype``). ``ValueError`` names a bad value."""
    if layout not in LAYOUTS:
        raise ValueError(f"worker_bytes: layout={layout!r} is not one of {LAYOUTS} (reduction=)")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"worker_bytes: workers={workers!r} must be a positive integer (the data-parallel width)")
    sizes = [int(n) for n in unit_numels]
    if any(n < 0 for n in sizes) or root_numel < 0:
        raise ValueError(f"worker_bytes: element counts must be >= 0, got units {sizes} and root {root_numel}")
    if not optimizer_slots >= 0:
        raise ValueError(f"worker_bytes: optimizer_slots={optimizer_slots!r} must be >= 0")
    if offload and layout != "fsdp":
        raise ValueError(f"worker_bytes: offload applies to layout='fsdp' only (got {layout!r}); offload=")
    g = param_bytes if grad_bytes is None else grad_bytes
    s = param_bytes if state_bytes is None else state_bytes
    q = param_bytes if gathered_bytes is None else gathered_bytes
    every = sizes + ([root_numel] if root_numel else [])
    n = sum(every)
    if layout == "allreduce":
        return WorkerBytes(layout, workers, n * param_bytes, n * g, optimizer_slots * n * s, activations=activations)
    if layout == "sharded":
        part = _shard(n, workers)
        return WorkerBytes(layout, workers, n * param_bytes, n * g, optimizer_slots * part * s,
                           activations=activations)
    shards = sum(_shard(u, workers) for u in every)
    peak = sum(sizes) if keep_gathered else sum(sorted(sizes, reverse=True)[:2])
    whole = peak + root_numel
    grads_whole = sum(sorted(sizes, reverse=True)[:2]) + root_numel
    return WorkerBytes(layout, workers, shards * param_bytes, shards * g, optimizer_slots * shards * s,
                       gathered_params=whole * q, gathered_grads=grads_whole * reduce_bytes,
                       activations=activations, offload=offload)


def optimizer_slots(kind: str, groups: Sequence[Mapping[str, Any]]) -> int:
    """State elements per parameter element of a ``torch.optim`` optimizer of class name ``kind``
    with ``param_groups`` ``groups`` (the most over the groups): Adam/AdamW 2 (3 with
    ``amsgrad``), SGD 1 with momentum else 0; ``ValueError`` for another optimizer (the sharded
    layouts take only these elementwise ones)."""
    if kind in ("Adam", "AdamW"):
        return max((3 if g.get("amsgrad") else 2) for g in groups) if groups else 2
    if kind == "SGD":
        return max((1 if g.get("momentum", 0) else 0) for g in groups) if groups else 0
    raise ValueError(f"optimizer_slots: {kind} is not Adam, AdamW or SGD, whose state per element is known "
                     f"(Job.optimizer)")


def check_host_memory(per_worker_bytes: float, workers_on_host: int, available_bytes: float | None) -> None:
    """``offload="cpu"``: refuse when the ``workers_on_host`` workers' host-resident bytes
    (``per_worker_bytes`` each: their shards of parameters, gradients and optimizer state) exceed
    the host's ``available_bytes`` (``None``: unknown, nothing refused)."""
    if available_bytes is None:
        return
    need = per_worker_bytes * workers_on_host
    if need > available_bytes:
        raise ValueError(f"offload='cpu' keeps each worker's parameter shards, gradients and optimizer state in host "
                         f"memory: {workers_on_host} worker(s) on this host x {per_worker_bytes / 2**30:.3g} GiB = "
                         f"{need / 2**30:.3g} GiB, more than the {available_bytes / 2**30:.3g} GiB available; spread "
                         f"the workers over more hosts (--backend ray or external), free host memory, or drop "
                         f"offload (--offload)")
