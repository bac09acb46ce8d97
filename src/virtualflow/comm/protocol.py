"""The keys and messages coordinator and workers exchange through the job's TCPStore.

Control plane only; tensors travel over process groups. Keys:

* ``vf/generation``            number of the latest membership generation (decimal string)
* ``vf/gen/<g>``               JSON :class:`GenerationRecord` of generation ``g``
* ``vf/control/seq``           number of the latest control command (0: none)
* ``vf/control/<n>``           JSON command ``n`` (``{"op": "stop"}``, ``{"op": "regroup"}``)
* ``vf/member/<w>/next/<g>``   where worker ``w`` goes after generation ``g`` ends (planned or
                               broken): the next generation number, or ``leave``/``fail``.
                               ``g = -1`` is a newcomer's entry point.
* ``vf/gen/<g>/arrived``       counter: members that reached generation ``g``'s rendezvous
* ``vf/gen/<g>/abort``         set when generation ``g`` is broken (a member died or hung)
* ``vf/gen/<g>/formed``        set by rank 0 once generation ``g``'s group and state are ready
* ``vf/hb/<w>``                worker ``w``'s heartbeat counter (incremented by a thread)
* queue ``vf/reports``         JSON messages from workers (join, ready, formed, step, fault,
                               leave, eval, error, done)
* queue ``vf/requests``        JSON requests from outside the job (``virtualflow resize``)

Process groups of generation ``g`` live under ``PrefixStore(f"gen/{g}", store)``, a namespace
no key above can collide with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

GENERATION_KEY = "vf/generation"
CONTROL_SEQ_KEY = "vf/control/seq"
REPORTS_QUEUE = "vf/reports"
REQUESTS_QUEUE = "vf/requests"
LEAVE = "leave"
FAIL = "fail"


def generation_key(g: int) -> str:
    return f"vf/gen/{g}"


def control_key(n: int) -> str:
    return f"vf/control/{n}"


def next_key(worker: int, generation: int) -> str:
    return f"vf/member/{worker}/next/{generation}"


def arrived_key(generation: int) -> str:
    return f"vf/gen/{generation}/arrived"


def formed_key(generation: int) -> str:
    return f"vf/gen/{generation}/formed"


def abort_key(generation: int) -> str:
    return f"vf/gen/{generation}/abort"


def heartbeat_key(worker: int) -> str:
    return f"vf/hb/{worker}"


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """One membership epoch: who works, which VNs each runs, from which step on."""

    generation: int
    members: list[int]
    """Worker ids; a worker's rank in this generation is its index here."""
    assignment: list[list[int]]
    """``assignment[rank]`` = VN ids that rank runs, in order."""
    start_step: int
    """Step the generation was published at (informational: members agree on the step to run
    when they form the group; a newcomer learns it in the state transfer)."""
    hold: bool = False
    """Fewer members than ``min_workers``: form, checkpoint, and wait for the next generation
    instead of training."""
    reason: str = ""
    vn_sizes: list[int] | None = None
    """Samples per VN when VN sizes differ per worker (``uneven_vn_sizes``); None: ``B/V`` each."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "GenerationRecord":
        return cls(**json.loads(text))


def push_report(store: dist.Store, message: dict[str, Any]) -> None:
    store.queue_push(REPORTS_QUEUE, json.dumps(message))


def pop_reports(store: dist.Store, limit: int = 1000, queue: str = REPORTS_QUEUE) -> list[dict[str, Any]]:
    """Non-blocking: every message queued so far (up to ``limit``)."""
    out = []
    n = min(store.queue_len(queue), limit)
    for _ in range(n):
        out.append(json.loads(store.queue_pop(queue, block=False)))
    return out
