"""Where a pipeline stage's step time goes: the step breakdown of a pipelined job, per stage.

Purpose: a :class:`~virtualflow.runtime.breakdown.StepClock` per stage engine, fed from two
places: the executor adds each compute action's seconds (forward, backward, the first and last
stages' data loading, an emulated slowdown), and :meth:`StageTiming.timed` wraps the step's
request generator and adds how long each request kept the engine suspended, by what it waited
for (:data:`KINDS`): a send or a posted receive is ``p2p_s``, a receive or the step's statistics
all-reduce is ``bubble_s`` (waiting for another stage), the stage's reduction over its replicas is
``blocked_s`` (split on rank 0 into ``reduction_s`` and ``straggler_s`` within the stage group)
and the sharded parameters' all-gather is ``optimizer_s``. What each part means per stage is in
:mod:`virtualflow.runtime.breakdown`.

Transport, as the VN engine's: a worker's raw vector of step ``s`` is known when step ``s+1``
starts; it rides in step ``s+1``'s statistics all-reduce (each worker in its rank's slot, with
its stage), and rank 0 hands every worker's raw vector and stage on (:meth:`StageTiming.raw`); the
parts are derived where they are read (the coordinator, for the step report).

Invariants: the intervals partition the step period (the rest is ``overhead_s``/``control_s``),
so a worker's parts add up to its ``step_s``; the slot block has the same size on every worker of
a generation (``slot`` is set for all of them or for none).
"""

from __future__ import annotations

from typing import Any, Generator

import torch

from virtualflow.runtime.breakdown import RAW, Raw, StepClock
from virtualflow.runtime.pipeline.requests import (AllSum, Expect, Poll, Recv, Send, StageGather, StageScatter,
                                                   StageSum, StageTree, TreeOpen, TreePart)

__all__ = ["KINDS", "StageTiming", "write_timeline"]

KINDS: dict[type, str] = {
    Send: "p2p_s", Expect: "p2p_s", Poll: "p2p_s", TreeOpen: "p2p_s", TreePart: "p2p_s",
    Recv: "bubble_s", AllSum: "bubble_s",
    StageSum: "reduction", StageTree: "reduction", StageScatter: "reduction",
    StageGather: "optimizer_s",
}
"""Which part the time a request keeps the engine suspended goes to."""


class StageTiming:
    """One stage engine's step clock, and its slot in the statistics all-reduce."""

    def __init__(self, enabled: bool = True) -> None:
        self.clock = StepClock(enabled)
        self.slot: tuple[int, int] | None = None
        """(this worker's rank, the generation's size) once known (set by whoever runs the
        generation: the worker engine, the in-process driver); ``None``: no breakdown."""
        self.stage_rank = 0
        self._reduced = False  # the step's first reduction request was seen (enter_reduction)

    def new_generation(self, slot: tuple[int, int] | None, stage_rank: int) -> None:
        self.clock.reset()
        self.slot = slot
        self.stage_rank = stage_rank

    def begin(self) -> None:
        """A step starts (its period is measured from here to the next one's start)."""
        self.clock.begin()
        self._reduced = False

    def compute(self, kind: str, seconds: float, input_s: float = 0.0, emulated_s: float = 0.0) -> None:
        """A compute action (``F``, ``B``, ``I`` or ``W``) took ``seconds`` (its data loading,
        ``input_s``, included; an emulated slowdown's sleep, ``emulated_s``, not)."""
        clock = self.clock
        clock.add("input_s", input_s)
        clock.add("forward_s" if kind == "F" else "backward_s", max(0.0, seconds - input_s))
        clock.add("emulated_s", emulated_s)

    def timed(self, gen: Generator) -> Generator[Any, Any, Any]:
        """``gen``'s requests passed on, the time each keeps it suspended added to its part."""
        clock = self.clock
        now = clock.now  # (a test may give the clock another time source)
        answer: Any = None
        try:
            req = next(gen)
            while True:
                part = KINDS.get(type(req))
                first = part == "reduction" and not self._reduced
                if first:
                    self._reduced = True
                    clock.enter_reduction()
                t0 = now()
                answer = yield req
                if first:
                    clock.leave_reduction()
                elif part == "reduction":
                    clock.add("blocked_s", now() - t0)
                elif part is not None:
                    clock.add(part, now() - t0)
                req = gen.send(answer)
        except StopIteration as stop:
            return stop.value

    # ---- transport --------------------------------------------------------------------------
    @property
    def block_numel(self) -> int:
        """Entries of the statistics vector this step's breakdown takes (0 without a slot)."""
        if self.slot is None or not self.clock.enabled:
            return 0
        return self.slot[1] * (1 + len(RAW))

    def pack(self, out: torch.Tensor) -> None:
        """This worker's raw vector of the previous step into its slot of ``out`` (zeros elsewhere;
        nothing before a generation's second step)."""
        prev = self.clock.previous()
        if self.slot is None or prev is None or not out.numel():
            return
        k = 1 + len(RAW)
        rank = self.slot[0]
        out[rank * k] = float(self.stage_rank + 1)
        out[rank * k + 1: (rank + 1) * k] = torch.tensor(prev, dtype=out.dtype)

    def raw(self, block: torch.Tensor) -> Raw | None:
        """Rank 0: every worker's raw vector of the previous step and its stage, from the summed
        block (None unless every worker had one, or elsewhere than rank 0); derived where it is
        read (:meth:`Raw.derive`)."""
        if self.slot is None or self.slot[0] != 0 or not block.numel():
            return None
        k = 1 + len(RAW)
        rows = block.view(self.slot[1], k).tolist()
        if any(row[0] <= 0 for row in rows):
            return None
        return Raw([row[1:] for row in rows], groups=[int(row[0]) for row in rows])


def write_timeline(timeline: list[dict[str, Any]], timeline_dir: str | None, rank: int, replica: int, stage_rank: int,
                   generation: int) -> None:
    """Append a worker's recorded actions (``timeline``, emptied) to ``timeline-<rank>.jsonl`` in
    ``timeline_dir`` (``pipeline/`` of the run's state directory; ``virtualflow plot RUN_DIR
    --pipeline`` draws them); ``rank``: the worker's generation rank. ``None``: nothing is kept."""
    import json
    import os

    if timeline_dir is None:
        timeline.clear()
        return
    os.makedirs(timeline_dir, mode=0o700, exist_ok=True)
    path = os.path.join(timeline_dir, f"timeline-{rank}.jsonl")
    with open(path, "a") as f:
        for e in timeline:
            f.write(json.dumps({**e, "rank": rank, "replica": replica, "stage_rank": stage_rank,
                                "generation": generation}) + "\n")
    timeline.clear()
