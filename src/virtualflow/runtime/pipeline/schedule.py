"""The schedule a pipeline runs, and where its bubbles are.

Purpose: the runtime's one way to a :class:`~virtualflow.plan.pipeline.Schedule`
(:func:`schedule_for`, a call of the one schedule factory
:func:`virtualflow.plan.pipeline.schedules.build_schedule`), and the idle slots of a schedule
where eager redundant forwards go (:func:`idle_slots`).

Invariants: schedules are pure and immutable, so they are built once per shape (the factory
caches them), not once per step; nothing in the runtime builds schedules another way.
"""

from __future__ import annotations

import functools

from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline import Schedule
from virtualflow.plan.pipeline.schedules import build_schedule


def schedule_for(pipeline: Pipeline, m: int, steps: int = 1) -> Schedule:
    """The schedule of ``pipeline`` for ``m`` micro-batches (and ``steps`` streamed steps)."""
    return build_schedule(pipeline.schedule, pipeline.stages, m, pipeline.chunks, steps)


@functools.lru_cache(maxsize=64)
def idle_slots(name: str, p: int, m: int, b_over_f: float) -> tuple[tuple[float, ...], ...]:
    """Per stage-rank: for each action of a one-step schedule, the time a receive waits for its
    message (0 for other actions), then one more entry: the time from the rank's last action to
    the end of the step (when the slowest rank is done) - in forward times, every stage's forward
    taking 1 and its backward ``b_over_f`` (:func:`virtualflow.plan.pipeline.simulate.simulate`).
    These are the schedule's bubbles, where eager redundant forwards go."""
    from virtualflow.plan.pipeline.simulate import simulate

    sim = simulate(build_schedule(name, p, m, 1, 1), 1.0, b_over_f)
    return tuple(tuple(float(sl.end - sl.start) if sl.action.kind in ("RECV_F", "RECV_B") else 0.0 for sl in rank)
                 + (float(sim.step_time - (rank[-1].end if rank else 0)),) for rank in sim.timeline)
