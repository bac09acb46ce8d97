"""The membership controller's phases: one value says where the job's membership stands.

::

    new --start--> forming --formed--> training --resize/notice/rebalance/...--> changing
                                          |  ^                                     |
                                          |  +-------------formed------------------+
                                          +--loss / broken generation--> recovering --formed--> training
    any of those --fewer than min_workers--> holding --enough workers--> changing (resume)
    any live phase --the job's last step--> finished        any live phase --gave up--> failed

* ``new``: built, no generation published yet.
* ``forming``: the first generation is published and has not formed.
* ``training``: the latest generation formed; the job trains (the controller plans resizes and
  rebalances only here).
* ``changing``: a planned change (grow, shrink, rebalance, reconfigure, preemption, resume, a
  generation of members the autoscaler chose) is published and has not formed.
* ``recovering``: a generation after a loss (a failure, a Bamboo failover, a broken generation
  retried) is published and has not formed.
* ``holding``: fewer workers than ``min_workers``: members form the hold generation,
  checkpoint and wait for enough workers (or the timeout).
* ``finished`` (the job's last step is done) and ``failed`` (the controller raised: the job
  ends): terminal, never left.

Invariants: the phase is one value (:class:`Phase`), changed only by the controller's
``_enter``, which logs every transition as ``previous -> next``; a terminal phase is never left.
The change in flight (:class:`Change`) is the data of ``forming``, ``changing``,
``recovering`` and of an unformed hold.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    """Where the membership stands (see the module docstring); ``.value`` is what ``virtualflow
    status`` prints."""

    NEW = "new"
    FORMING = "forming"
    TRAINING = "training"
    CHANGING = "changing"
    RECOVERING = "recovering"
    HOLDING = "holding"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.FINISHED, Phase.FAILED)


RECOVERY_KINDS = frozenset({"failure", "failover"})
"""Kinds of change published after a loss (the others are planned)."""


def phase_of_change(kind: str, *, hold: bool) -> Phase:
    """The phase a published, not yet formed generation of this ``kind`` puts the job in."""
    if hold:
        return Phase.HOLDING
    if kind == "start":
        return Phase.FORMING
    if kind in RECOVERY_KINDS:
        return Phase.RECOVERING
    return Phase.CHANGING


@dataclass(slots=True)
class Change:
    """A published generation that has not formed yet: what kind of change it is and when it
    was published (the controller's clock)."""

    generation: int
    kind: str  # start | grow | shrink | failure | failover | hold | resume | rebalance | reconfigure | preempted
    t_start: float
    detail: dict[str, Any] = field(default_factory=dict)
