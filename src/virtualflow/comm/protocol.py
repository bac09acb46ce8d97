"""The keys and messages coordinator and workers exchange through the job's TCPStore.

Control plane only; tensors travel over process groups. Keys:

* ``vf/generation``            number of the latest membership generation (decimal string)
* ``vf/gen/<g>``               JSON :class:`GenerationRecord` of generation ``g``
* ``vf/control/seq``           number of the latest control command (0: none)
* ``vf/control/<n>``           JSON command ``n`` (``{"op": "stop"}``)
* queue ``vf/reports``         JSON messages from workers (join, step, eval, error, done)

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


def generation_key(g: int) -> str:
    return f"vf/gen/{g}"


def control_key(n: int) -> str:
    return f"vf/control/{n}"


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """One membership epoch: who works, which VNs each runs, from which step on."""

    generation: int
    members: list[int]
    """Worker ids; a worker's rank in this generation is its index here."""
    assignment: list[list[int]]
    """``assignment[rank]`` = VN ids that rank runs, in order."""
    start_step: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "GenerationRecord":
        return cls(**json.loads(text))


def push_report(store: dist.Store, message: dict[str, Any]) -> None:
    store.queue_push(REPORTS_QUEUE, json.dumps(message))


def pop_reports(store: dist.Store, limit: int = 1000) -> list[dict[str, Any]]:
    """Non-blocking: every report queued so far (up to ``limit``)."""
    out = []
    n = min(store.queue_len(REPORTS_QUEUE), limit)
    for _ in range(n):
        out.append(json.loads(store.queue_pop(REPORTS_QUEUE, block=False)))
    return out
