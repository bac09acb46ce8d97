"""What the membership policies decide, as data: the controller alone carries a decision out.

A policy (:mod:`.speed`, :mod:`.failover`) reads what the controller tells it (members, layout,
measurements) and returns one of these frozen values; it never publishes a generation, starts or
kills a worker, writes a record or reads a clock. The controller
(:class:`~virtualflow.control.membership.controller.MembershipController`) turns a decision into
a generation, worker starts and events. So the policies are tested on plain inputs
(``tests/unit/test_membership_policies.py``) and the controller's rules stay in one place.

Invariants: every decision is immutable; member lists are in rank order (the order the next
generation publishes them in); layouts are flat layouts of
:mod:`virtualflow.plan.pipeline.failover` (``None``: every member runs one stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Layout = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class NoChange:
    """Nothing to publish (``reason`` says why, for a reader or a test)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Rebalance:
    """Same members, a new VN map (speed model). ``revert_to``: the VN counts of the map before
    a rebalance that made steps slower (the map to go back to); None: the solver's best map.
    ``trial_step_s``: the measured step time the new map will be judged against (None: not
    judged). ``detail`` goes into the change's ``formed`` event."""

    detail: dict[str, Any] = field(default_factory=dict)
    revert_to: tuple[int, ...] | None = None
    trial_step_s: float | None = None
    counts_before: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicaLeft:
    """A pipeline replica that could not cover its loss and leaves whole."""

    replica: int
    workers: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class ReplicaCovered:
    """A pipeline replica that covered a loss: who took whose stages over, and its new layout.
    ``numbered``: the job has several replicas (the event names this one)."""

    replica: int
    taken_over: dict[str, int]
    layout: list[list[int]]
    numbered: bool


@dataclass(frozen=True, slots=True)
class Failover:
    """Bamboo: lost (or noticed) workers' predecessors take their stages over.

    ``members``: the survivors, in rank order; ``kind``: ``failover`` when a replica covered a
    loss, ``failure`` when only whole replicas left; ``layout``: the new flat layout (in the
    published record); ``layout_after``: what the controller keeps once published (None when
    every replica is back at full depth); ``target``: the job's new size (with replacements
    counted when ``replace_failed``); ``replacements``: workers to start now; ``dropped``:
    current members that leave."""

    members: tuple[int, ...]
    kind: str
    layout: Layout | None
    layout_after: Layout | None
    target: int
    replacements: int
    dropped: tuple[int, ...]
    covered: tuple[ReplicaCovered, ...]
    left: tuple[ReplicaLeft, ...]


@dataclass(frozen=True, slots=True)
class FallBack:
    """Bamboo: redundancy cannot cover the loss; the run restarts from its last checkpoint."""

    reason: str


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """Bamboo: ready newcomers take back stages a failover gave to other workers.
    ``members``: the new rank order (newcomers placed); ``added``: the newcomers, in order;
    ``layout``: the published flat layout; ``layout_after``: None once at full depth."""

    members: tuple[int, ...]
    added: tuple[int, ...]
    layout: Layout
    layout_after: Layout | None


@dataclass(frozen=True, slots=True)
class Shrink:
    """Members leave (the highest ranks, or whole pipeline replicas). ``target``: the job's size
    after it; ``layout`` / ``layout_after``: as for :class:`Failover` (None without Bamboo).
    A shrink with no ``removed`` only sets the target (nothing to publish)."""

    members: tuple[int, ...]
    removed: tuple[int, ...]
    target: int
    layout: Layout | None = None
    layout_after: Layout | None = None


@dataclass(frozen=True, slots=True)
class Recover:
    """After a loss: ``members`` go on in the next generation (a ``hold`` when they are fewer
    than ``min_workers``), the job's size becomes ``target``, ``replacements`` workers start."""

    members: tuple[int, ...]
    target: int
    replacements: int
    hold: bool


@dataclass(frozen=True, slots=True)
class Resume:
    """Holding, enough workers are ready: ``added`` join the members and training resumes."""

    members: tuple[int, ...]
    added: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StartWorkers:
    """Start workers so that ``count`` newcomers are on their way (ready, pending or new)."""

    count: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The membership cannot go on: the job fails with ``message`` (cause, then what helps)."""

    message: str


@dataclass(frozen=True, slots=True)
class Grow:
    """The job grows by ``need`` workers: newcomers are started until ``need`` are on their way;
    once ``need`` are ready, ``added`` (empty until then) join ``members``, the new rank order."""

    members: tuple[int, ...]
    added: tuple[int, ...]
    need: int
