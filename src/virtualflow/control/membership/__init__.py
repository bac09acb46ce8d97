"""Membership control: who works in which generation, decided by one controller in the coordinator.

* :mod:`.controller`: :class:`MembershipController`, the state machine that publishes
  generations and alone acts (starts workers, writes records, tells members to regroup).
* :mod:`.hangs`, :mod:`.losses`, :mod:`.changes`: the controller's collaborators carrying out
  the policies' decisions (stalls and unformed generations; lost workers and broken generations;
  planned resizes, holds, notices and reconfigurations) on its fields, publishing through it.
* :mod:`.phases`: its named phases (:class:`Phase`: new, forming, training, changing,
  recovering, holding, finished, failed), every transition logged as ``previous -> next``.
* :mod:`.decisions`: what a policy decides, as frozen data (:class:`Rebalance`,
  :class:`Failover`, :class:`FallBack`, :class:`Reconfigure`, :class:`Shrink`, :class:`Grow`,
  :class:`Recover`, :class:`Resume`, :class:`StartWorkers`, :class:`GiveUp`, :class:`NoChange`).
* :mod:`.speed`: the speed model of heterogeneous workers (VN maps, rebalances), a policy.
* :mod:`.failover`: Bamboo's failover of redundant pipeline replicas, a policy.
* :mod:`.sizing`: losses, holds, notices and resizes without redundancy, a policy.
* :mod:`.liveness`: which workers are gone (exit codes, heartbeats; fencing).
* :mod:`.watchdog`: step progress and the formation bound: a run hung in the job's own code,
  its wedged workers (a policy).
* :mod:`.interface`: the launcher it drives, its errors, the resize check.

The policies are pure (no store, no processes, no clock) and tested without processes
(``tests/unit/test_membership_policies.py``).
"""

from __future__ import annotations

from virtualflow.control.membership.controller import MembershipController
from virtualflow.control.membership.decisions import (
    FallBack,
    Failover,
    GiveUp,
    Grow,
    NoChange,
    Rebalance,
    Reconfigure,
    Recover,
    ReplicaCovered,
    ReplicaLeft,
    Resume,
    Shrink,
    StartWorkers,
)
from virtualflow.control.membership.interface import (
    FallbackRestart,
    JobFailed,
    WorkerLauncher,
    check_resize,
    describe_exit,
)
from virtualflow.control.membership.phases import Change, Phase
from virtualflow.control.membership.speed import MapPlan, SpeedPolicy, timed_compute

__all__ = [
    "Change",
    "FallBack",
    "FallbackRestart",
    "Failover",
    "GiveUp",
    "Grow",
    "JobFailed",
    "MapPlan",
    "MembershipController",
    "NoChange",
    "Phase",
    "Rebalance",
    "Reconfigure",
    "Recover",
    "ReplicaCovered",
    "ReplicaLeft",
    "Resume",
    "Shrink",
    "SpeedPolicy",
    "StartWorkers",
    "WorkerLauncher",
    "check_resize",
    "describe_exit",
    "timed_compute",
]
