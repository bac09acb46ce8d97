"""Who goes on after a loss, a notice or a resize without redundancy, and when a holding job
resumes or gives up: pure decisions of the membership controller (:mod:`.decisions`).

* :func:`decide_loss`: members were lost. The survivors go on (a pipelined job keeps its whole
  replicas only); fewer than ``min_workers`` make the next generation a hold; with
  ``replace_failed`` one worker starts per member gone; with no one left the job gives up.
* :func:`decide_hold`: the job holds (fewer than ``min_workers``). Enough ready workers resume
  it; after ``min_workers_timeout_s`` it gives up naming the checkpoint; meanwhile the missing
  workers are started when they can come (``replace_failed`` or a larger target).
* :func:`decide_release`: members got a preemption notice; the others go on (a pipelined job
  loses the noticed workers' whole replicas) unless that leaves too few.
* :func:`decide_resize`: the target differs from the size: grow with ready newcomers only,
  or shrink by the highest ranks.

Pure: no store, no processes, no clock (the time held is an argument). Bamboo's redundant
pipelines are :mod:`.failover`'s.
"""

from __future__ import annotations

from typing import Sequence

from virtualflow.control.membership.decisions import (
    GiveUp,
    Grow,
    NoChange,
    Recover,
    Resume,
    Shrink,
    StartWorkers,
)
from virtualflow.control.membership.failover import whole_replicas


def decide_loss(*, members: Sequence[int], failed: dict[int, str], pids: dict[int, int | None],
                stages: int | None, replace_failed: bool, target: int, min_workers: int,
                step: int, checkpointed: bool = False) -> Recover | GiveUp:
    """Members in ``failed`` (worker -> cause) are gone from a job without redundancy (see the
    module docstring). ``pids`` name the lost workers' processes in the message; ``step`` is
    the step the job had reached; ``checkpointed``: the run has a state to continue from (a
    checkpoint written, or the state it resumed from), which the message then points to
    instead of the ``checkpoint_every`` knob."""
    survivors = [w for w in members if w not in failed]
    if stages is not None and survivors:
        # A pipelined job goes on with its whole replicas only (members keep their order, so
        # every survivor keeps its stage); the rest of a broken replica leaves.
        survivors = whole_replicas(members, failed, stages)
        if not survivors:
            lost_desc = "; ".join(f"worker {w} {c}" for w, c in failed.items())
            return GiveUp(
                f"{lost_desc} at step {step}: every pipeline replica lost a stage, so no whole "
                f"pipeline is left to continue; run with more replicas (--workers a larger multiple of "
                f"{stages}) to survive a failure"
            )
    if not survivors:
        lost_desc = "; ".join(f"worker {w} (pid {pids.get(w)}) {c}" for w, c in failed.items())
        return GiveUp(
            f"{lost_desc} at step {step}, and no worker is left to continue the job; " + (
                "continue it from its last checkpoint with `virtualflow run ... --resume RUN_DIR`" if checkpointed
                else "with checkpoint_every= (--checkpoint-every) a later run can resume from the last "
                     "checkpoint (--resume RUN_DIR)")
        )
    # Without replace_failed the job goes on smaller; with it, one replacement per member gone
    # (a pipelined job also loses the rest of a broken replica).
    replacements = len(members) - len(survivors) if replace_failed else 0
    return Recover(tuple(survivors), target if replace_failed else max(min(target, len(survivors)), 1),
                   replacements, hold=len(survivors) < min_workers)


def decide_hold(*, members: Sequence[int], ready: Sequence[int], target: int, min_workers: int,
                held_s: float | None, timeout_s: float, replace_failed: bool, checkpoint: str | None,
                step: int) -> Resume | GiveUp | StartWorkers | NoChange:
    """The job holds with ``members``; ``ready`` workers have joined and wait; it has held for
    ``held_s`` seconds (None: not timed). See the module docstring."""
    size = len(members)
    if size + len(ready) >= min_workers:
        add = tuple(ready[: max(min_workers, target) - size])
        return Resume(tuple(members) + add, add)
    if held_s is not None and held_s > timeout_s:
        return GiveUp(
            f"only {size} worker{'s' if size != 1 else ''} left, below min_workers={min_workers}, "
            f"and no replacement arrived within {timeout_s:g} s; the state at step "
            f"{step} is in {checkpoint}. Continue with `virtualflow run ... --resume RUN_DIR`, "
            f"lower min_workers, or use replace_failed (--replace-failed)"
        )
    if replace_failed or target > size:
        return StartWorkers(max(min_workers, target) - size)
    return NoChange("holding: waiting for workers")


def decide_release(*, members: Sequence[int], noticed: Sequence[int], stages: int | None,
                   min_workers: int) -> Shrink | NoChange:
    """A planned shrink without the ``noticed`` members (every member regroups at the same step
    boundary); nothing when no one, or fewer than ``min_workers``, would be left to hand over
    to (the notice runs out and the loss is a failure then)."""
    if stages is not None:
        keep = whole_replicas(members, set(noticed), stages)
    else:
        keep = [w for w in members if w not in noticed]
    if not keep or len(keep) < min_workers:
        return NoChange("nothing to hand over to")
    return Shrink(tuple(keep), tuple(w for w in members if w not in keep), len(keep))


def decide_resize(*, members: Sequence[int], ready: Sequence[int], target: int) -> Grow | Shrink | NoChange:
    """Towards ``target`` workers: a grow adds ready newcomers only (survivors never wait for a
    start-up), a shrink keeps the lowest ranks."""
    size = len(members)
    if target > size:
        need = target - size
        added = tuple(ready[:need]) if len(ready) >= need else ()
        return Grow(tuple(members) + added, added, need)
    if target < size:
        return Shrink(tuple(members[:target]), tuple(members[target:]), target)
    return NoChange("at the target size")
