"""What the membership controller's collaborators (:mod:`.hangs`, :mod:`.losses`,
:mod:`.changes`) read and write of it: :class:`Roster`, a structural type that
:class:`~virtualflow.control.membership.controller.MembershipController` satisfies.

Invariant: the collaborators name only these fields and methods; the controller stays the one
place that publishes generations (:meth:`Roster.publish_next`, :meth:`Roster.publish`) and starts
workers (:meth:`Roster.new_worker`).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from virtualflow.control.membership.interface import WorkerLauncher
from virtualflow.control.membership.liveness import Liveness
from virtualflow.control.membership.phases import Change, Phase
from virtualflow.control.membership.speed import SpeedPolicy
from virtualflow.control.membership.watchdog import StepWatchdog

Layout = tuple[tuple[int, ...], ...]


class Roster(Protocol):
    """The controller's fields and actions its collaborators use (see the module docstring)."""

    coord: Any
    launcher: WorkerLauncher
    liveness: Liveness
    watchdog: StepWatchdog
    speed_policy: SpeedPolicy
    phase: Phase
    # the job's shape and settings
    stages: int | None
    redundancy: bool
    shards_die_with_members: bool
    balance: bool
    replace_failed: bool
    min_workers: int
    min_workers_timeout_s: float
    heartbeat_timeout_s: float
    # the membership
    target: int
    members: list[int]
    assignment: list[list[int]]
    vn_sizes: list[int] | None
    generation: int
    formed: int
    last_step: int
    layout: Layout | None
    formed_layout: tuple[list[int], Layout | None] | None
    assigned: dict[int, int]
    pending: dict[int, float]
    ready: list[int]
    joined: set[int]
    noticed: list[int]
    hold_since: float | None
    hold_checkpoint: str | None
    checkpointed: bool
    failures: list[dict[str, Any]]
    bamboo_events: list[dict[str, Any]]

    @property
    def busy(self) -> bool: ...

    @property
    def hold(self) -> bool: ...

    @property
    def stalled(self) -> bool: ...

    @property
    def change_in_flight(self) -> Change | None: ...

    def new_worker(self) -> int: ...

    def publish(self, members: list[int], *, kind: str, detail: dict[str, Any] | None = None) -> None: ...

    def publish_next(self, members: list[int], *, kind: str, hold: bool, command: bool = False,
                     detail: dict[str, Any] | None = None, counts: Sequence[int] | None = None) -> None: ...
