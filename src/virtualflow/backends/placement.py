"""Placements: where the cluster service's slots are, chosen once when the service starts.

The cluster service (:mod:`virtualflow.service`) schedules jobs onto named slots of accelerator
types (``v100-0``, ``k80-1``, ...). *Where* a job's workers then run is the placement's business,
behind the small :class:`Placement` protocol; the service holds one placement, made from its
configuration by :func:`placement_of` (the only place that looks at the backend's name), and never
branches on a backend itself.

- :class:`LocalPlacement` (``--backend local``): slots are emulated on this machine; every worker
  is a local process and gets its type's slowdown (the types exist only as slowdowns).
- :class:`RayPlacement` (``--backend ray --address ADDR``): a slot of type ``T`` is one unit of
  the Ray custom resource ``T``; every worker of a job placed on ``T`` is a Ray actor asking for
  ``{T: 1}`` (and ``cpus_per_worker`` CPUs), so Ray puts it on a node that has a ``T`` free. The
  types' slowdowns only inform the estimates (the hardware is real) unless ``emulate_slowdowns``.
  The cluster must have at least as many units of each type as the slots claim, and the CPUs for
  all slots busy at once (:func:`ray_slot_shortage`): checked at ``cluster start`` and whenever the
  service starts (:meth:`Placement.check_slots`).

On either placement the jobs' *drivers* are local processes of the service (on Ray they own the
actors: Ray ends those with them), so a restarted service reaps the same way on both
(:meth:`Placement.reap_orphans`, :mod:`virtualflow.backends.orphans`).

Invariants: a placement is immutable once made; :func:`placement_of` validates every knob before
anything is written (errors name the value, the rule and the flag); nothing here branches on a
backend's name outside :func:`placement_of`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from virtualflow.backends.orphans import wait_orphans

__all__ = ["Placement", "LocalPlacement", "RayPlacement", "placement_of", "placement_from_config",
           "ray_slot_shortage", "check_ray_cluster", "PLACEMENTS"]

PLACEMENTS = ("local", "ray")
"""The names ``cluster start --backend`` accepts."""


class Placement(Protocol):
    """How the cluster service's slots map onto processes (see the module docstring)."""

    @property
    def name(self) -> str:
        """The backend's name, as configured (``local`` or ``ray``)."""
        ...

    @property
    def emulates_slowdowns(self) -> bool:
        """Whether a job's workers get their slot type's slowdown (the type is emulated)."""
        ...

    def check_slots(self, slots: Mapping[str, int]) -> None:
        """Raise ``ValueError`` (naming the slot type, what is there and the fix) when the
        slots cannot be held; called at ``cluster start`` and when the service starts."""
        ...

    def worker_options(self, acc_type: str) -> dict[str, Any]:
        """The :func:`virtualflow.launch` options that put every worker of a job (newcomers of
        a resize included) on a slot of type ``acc_type``."""
        ...

    def reap_orphans(self, run_dirs: list[str]) -> None:
        """After the service died: wait for the processes of the jobs in ``run_dirs`` it ran,
        and end those still there that are verifiably the job's."""
        ...


@dataclass(frozen=True, slots=True)
class LocalPlacement:
    """Slots emulated on this machine: workers are local processes slowed to their type."""

    @property
    def name(self) -> str:
        return "local"

    @property
    def emulates_slowdowns(self) -> bool:
        return True  # the types exist only as slowdowns here

    def check_slots(self, slots: Mapping[str, int]) -> None:
        return None  # emulated slots: any number fits

    def worker_options(self, acc_type: str) -> dict[str, Any]:
        return {}  # the job's own (local) backend

    def reap_orphans(self, run_dirs: list[str]) -> None:
        wait_orphans(run_dirs)


@dataclass(frozen=True, slots=True)
class RayPlacement:
    """Slots are units of Ray custom resources on the Ray cluster at ``address``."""

    address: str | None
    """``auto``, ``HOST:PORT`` of the Ray head (None: the one this process is connected to)."""
    cpus_per_worker: float = 1.0
    """Ray CPUs every worker asks for besides its slot."""
    emulate_slowdowns: bool = False
    """Whether workers also get their type's slowdown (``--emulate-slowdowns``)."""

    @property
    def name(self) -> str:
        return "ray"

    @property
    def emulates_slowdowns(self) -> bool:
        return self.emulate_slowdowns

    def check_slots(self, slots: Mapping[str, int]) -> None:
        check_ray_cluster(self.address, dict(slots), self.cpus_per_worker)

    def worker_options(self, acc_type: str) -> dict[str, Any]:
        # A slot of type T is one unit of the Ray resource T: every worker of the job (newcomers
        # of a resize included) asks for one, so Ray places it on a node that has one free.
        return dict(backend="ray", address=self.address, cpus_per_worker=self.cpus_per_worker,
                    resources={acc_type: 1.0})

    def reap_orphans(self, run_dirs: list[str]) -> None:
        # The jobs' drivers are local processes here too (they own the actors: Ray ends those with
        # them); a remote worker's pid in status.json never matches a local process that carries
        # the job's marker, so it is never signalled.
        wait_orphans(run_dirs)


def placement_of(backend: str, *, address: str | None = None, cpus_per_worker: float = 1.0,
                 emulate_slowdowns: bool = False) -> Placement:
    """The placement ``cluster start --backend BACKEND`` asks for, its knobs validated (nothing
    connects yet: :meth:`Placement.check_slots` does)."""
    if backend not in PLACEMENTS:
        raise ValueError(f"--backend {backend!r} is not a cluster backend; choose local (emulated slots on this "
                         f"machine) or ray (slots are Ray resources)")
    if backend == "local" and (address is not None or emulate_slowdowns):
        raise ValueError("--address and --emulate-slowdowns apply to --backend ray; add --backend ray or drop them")
    if not (math.isfinite(cpus_per_worker) and cpus_per_worker > 0):
        raise ValueError(f"--cpus-per-worker {cpus_per_worker:g} must be a positive number of Ray CPUs")
    if backend == "local":
        return LocalPlacement()
    if not address:
        raise ValueError("--backend ray needs --address (auto, or HOST:PORT of the Ray head) of a running Ray "
                         "cluster whose nodes have the slot types as custom resources, e.g. ray start --head "
                         "--resources '{\"v100\": 2, \"k80\": 2}'")
    return RayPlacement(address=address, cpus_per_worker=cpus_per_worker, emulate_slowdowns=emulate_slowdowns)


def placement_from_config(cfg: Mapping[str, Any]) -> Placement:
    """The placement a cluster directory's recorded configuration names (``backend``, ``address``,
    ``cpus_per_worker``, ``emulate_slowdowns``, as :func:`virtualflow.service.runner.init_cluster`
    validated and wrote them; a configuration without ``backend`` is a local one). Not validated
    again: what is recorded is what ``cluster start`` accepted."""
    if str(cfg.get("backend", "local")) == "ray":
        return RayPlacement(address=cfg.get("address"), cpus_per_worker=float(cfg.get("cpus_per_worker", 1.0)),
                            emulate_slowdowns=bool(cfg.get("emulate_slowdowns", False)))
    return LocalPlacement()


def ray_slot_shortage(slots: dict[str, int], totals: dict[str, float], cpus_per_worker: float,
                      where: str = "the Ray cluster") -> str | None:
    """Why a Ray cluster with resources ``totals`` cannot hold ``slots`` (pure), or None: each
    slot type T is a custom resource T with at least as many units as T has slots, and the
    slots busy at once need ``cpus_per_worker`` CPUs each."""
    custom = sorted(k for k in totals if k not in ("CPU", "GPU", "memory", "object_store_memory")
                    and not k.startswith(("node:", "accelerator_type:")))
    for t, n in slots.items():
        have = float(totals.get(t, 0.0))
        if have + 1e-9 < n:
            has = f"has {t}={have:g}" if have > 0 else f"has no resource {t!r}"
            fix = f"lower --slots {t}={int(have)}" if have >= 1 else f"drop {t} from --slots"
            return (f"slot type {t!r} claims {n} slot{'s' if n != 1 else ''} (--slots {t}={n}) but {where} {has} "
                    f"(its custom resources: {', '.join(f'{k}={totals[k]:g}' for k in custom) or 'none'}); {fix} "
                    f"or add Ray nodes started with --resources '{{\"{t}\": N}}'")
    need = sum(slots.values()) * cpus_per_worker
    cpus = float(totals.get("CPU", 0.0))
    if cpus + 1e-9 < need:
        return (f"the {sum(slots.values())} slots need {need:g} CPUs when all are busy ({sum(slots.values())} x "
                f"--cpus-per-worker {cpus_per_worker:g}) but {where} has CPU={cpus:g}; lower --cpus-per-worker "
                f"or --slots, or add nodes")
    return None


def check_ray_cluster(address: str | None, slots: dict[str, int], cpus_per_worker: float) -> None:
    """Connect to the Ray cluster (``address``: ``auto``, ``HOST:PORT``, or None for the one this
    process is connected to / ``RAY_ADDRESS``) and raise ``ValueError`` when it lacks the
    resources the slots claim (:func:`ray_slot_shortage`)."""
    from virtualflow.backends.ray import RayOptions, connect, import_ray

    ray = import_ray()
    connect(RayOptions(address=address))
    short = ray_slot_shortage(slots, ray.cluster_resources(), cpus_per_worker,
                              where=f"the Ray cluster at {address}" if address else "the Ray cluster")
    if short:
        raise ValueError(short)
