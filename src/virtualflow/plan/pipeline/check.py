"""Validity checker for pipeline schedules. Pure code, no processes.

``check(schedule)`` proves, or raises ``ScheduleError`` naming the rank, the action index and the
rule broken:

- ``well-formed``: every action's stage lives on its rank (``stage % p``), its chunk is
  ``stage // p``, its micro-batch id is in range, and a send/receive names the rank of the
  neighbouring stage and exists only where that neighbour is on another rank.
- ``exactly-once``: every (stage, micro-batch) gets one ``F`` and either one ``B`` or one ``I``
  and one ``W``, never both forms.
- ``forward-before-backward``: on its rank, a micro-batch's ``F`` precedes its ``B``/``I``, and
  its ``I`` precedes its ``W``.
- ``input-arrived``: a compute's input is on the rank before it runs: ``F`` of stage ``s`` after
  ``RECV_F`` (or after ``F`` of stage ``s-1`` when that stage is on the same rank), ``B``/``I``
  after ``RECV_B`` (or the backward of stage ``s+1``); a send after the compute producing it.
- ``send-recv-match``: every send has exactly one matching receive on its peer and vice versa.
- ``deadlock``: executing all ranks together, a receive blocking until its send has run, every
  rank reaches its end. With ``input-arrived`` this also proves stage order across ranks: ``F`` of
  stage ``s+1`` runs after ``F`` of stage ``s``, backwards in reverse.
- ``stash``: the peak number of (stage, micro-batch) activations a rank holds (forward done, last
  backward part not done) is at most ``schedule.stash_bound[rank]``.
- ``weight-versions``: the weight versions a stage must hold at once (those used by micro-batches
  in flight plus the newest) are at most ``schedule.weight_versions[stage]``, and every
  micro-batch sees the version its ``weight_rule`` promises.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedules import Action, Schedule


class ScheduleError(ValueError):
    """A schedule breaks a validity rule; ``rank``, ``index`` and ``rule`` say where and which."""

    def __init__(self, rank: int, index: int, rule: str, detail: str) -> None:
        super().__init__(f"rank {rank}, action {index}: rule '{rule}' broken: {detail}")
        self.rank, self.index, self.rule = rank, index, rule


@dataclass(frozen=True, slots=True)
class CheckResult:
    """What ``check`` measured on a valid schedule."""

    peak_stash: tuple[int, ...]
    """Per rank: the most activations held at once."""
    peak_weight_versions: tuple[int, ...]
    """Per stage: the most weight versions held at once."""


def message_key(action: Action) -> tuple[str, int, int, int]:
    """``(direction, from_stage, to_stage, microbatch)`` of the message a send/receive moves."""
    s, i = action.stage, action.microbatch
    return {
        "SEND_F": ("F", s, s + 1, i), "RECV_F": ("F", s - 1, s, i),
        "SEND_B": ("B", s, s - 1, i), "RECV_B": ("B", s + 1, s, i),
    }[action.kind]


def is_last_backward(action: Action, split: bool) -> bool:
    """True for the action that ends a micro-batch's backward on its stage (frees its stash)."""
    return action.kind == ("W" if split else "B")


def check(schedule: Schedule) -> CheckResult:
    """Prove ``schedule`` valid (see the module docstring) or raise ``ScheduleError``."""
    sch = schedule
    n = sch.microbatches
    split = sch.split_backward()
    producers: dict[tuple[str, int, int, int], tuple[int, int]] = {}
    consumers: dict[tuple[str, int, int, int], tuple[int, int]] = {}
    pos: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> index on its rank, all ranks
    for r, acts in enumerate(sch.actions):
        for k, a in enumerate(acts):
            _well_formed(sch, r, k, a)
            s, i = a.stage, a.microbatch
            if a.kind in ("F", "B", "I", "W"):
                if (a.kind, s, i) in pos:
                    first = pos[a.kind, s, i]
                    raise ScheduleError(r, k, "exactly-once", f"{a} runs a second time (first at action {first})")
                if (a.kind in ("I", "W") and ("B", s, i) in pos) or (a.kind == "B" and ("I", s, i) in pos):
                    raise ScheduleError(r, k, "exactly-once", f"{a} mixes a full backward B with a split I/W")
                _inputs_arrived(sch, r, k, a, pos)
                pos[a.kind, s, i] = k
            else:
                made = [("F", s, i)] if a.kind == "SEND_F" else [("I", s, i), ("B", s, i)]
                if a.kind.startswith("SEND") and not any(x in pos for x in made):
                    raise ScheduleError(r, k, "input-arrived", f"{a} sends data its stage has not produced yet")
                pos[a.kind, s, i] = k
                table = producers if a.kind.startswith("SEND") else consumers
                key = message_key(a)
                if key in table:
                    other_rank, other_index = table[key]
                    raise ScheduleError(
                        r, k, "send-recv-match", f"{a} duplicates action {other_index} on rank {other_rank}"
                    )
                table[key] = (r, k)
    for mine, theirs, what in ((producers, consumers, "receive"), (consumers, producers, "send")):
        for key, (r, k) in mine.items():
            if key not in theirs:
                a = sch.actions[r][k]
                raise ScheduleError(r, k, "send-recv-match", f"{a} has no matching {what} on rank {a.peer}")
    for s in range(sch.stages):
        r = sch.rank_of(s)
        for i in range(n):
            for kind in ("F", "I", "W") if split else ("F", "B"):
                if (kind, s, i) not in pos:
                    raise ScheduleError(
                        r, len(sch.actions[r]), "exactly-once", f"stage {s} never runs {kind} of micro-batch {i}"
                    )
    _no_deadlock(sch)
    stash = _stash(sch, split)
    versions = _weight_versions(sch, split)
    return CheckResult(stash, versions)


def _well_formed(sch: Schedule, r: int, k: int, a: Action) -> None:
    p, last = sch.p, sch.stages - 1
    bad = None
    if not 0 <= a.stage <= last:
        bad = f"stage {a.stage} outside 0..{last}"
    elif sch.rank_of(a.stage) != r:
        bad = f"stage {a.stage} lives on rank {sch.rank_of(a.stage)}, not {r}"
    elif a.chunk != a.stage // p:
        bad = f"chunk {a.chunk} is not stage // p = {a.stage // p}"
    elif not 0 <= a.microbatch < sch.microbatches:
        bad = f"micro-batch {a.microbatch} outside 0..{sch.microbatches - 1}"
    elif a.peer is not None:
        _, src, dst, _ = message_key(a)
        other = dst if a.kind.startswith("SEND") else src
        if not 0 <= other <= last:
            bad = f"{a.kind} at stage {a.stage} has no neighbour stage {other}"
        elif sch.rank_of(other) == r:
            bad = f"{a.kind} to stage {other} on the same rank (pass it locally)"
        elif a.peer != sch.rank_of(other):
            bad = f"peer {a.peer} is not rank {sch.rank_of(other)} holding stage {other}"
    if bad:
        raise ScheduleError(r, k, "well-formed", f"{a}: {bad}")


def _inputs_arrived(sch: Schedule, r: int, k: int, a: Action, pos: dict) -> None:
    s, i, last = a.stage, a.microbatch, sch.stages - 1
    if a.kind == "F":
        if s > 0:
            local = sch.rank_of(s - 1) == r
            if (("F", s - 1, i) if local else ("RECV_F", s, i)) not in pos:
                what = f"F of stage {s - 1}" if local else "its RECV_F"
                raise ScheduleError(r, k, "input-arrived", f"{a} runs before {what}")
        return
    if a.kind == "W":
        if ("I", s, i) not in pos:
            raise ScheduleError(r, k, "forward-before-backward", f"{a} runs before I of the same micro-batch")
        return
    if ("F", s, i) not in pos:
        raise ScheduleError(r, k, "forward-before-backward", f"{a} runs before its forward F")
    if s < last:
        if sch.rank_of(s + 1) == r:
            if ("B", s + 1, i) not in pos and ("I", s + 1, i) not in pos:
                raise ScheduleError(r, k, "input-arrived", f"{a} runs before the backward of stage {s + 1}")
        elif ("RECV_B", s, i) not in pos:
            raise ScheduleError(r, k, "input-arrived", f"{a} runs before its RECV_B")


def _no_deadlock(sch: Schedule) -> None:
    ptr = [0] * sch.p
    sent: set[tuple[str, int, int, int]] = set()
    while True:
        progressed = False
        for r, acts in enumerate(sch.actions):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if a.kind.startswith("RECV") and message_key(a) not in sent:
                    break
                if a.kind.startswith("SEND"):
                    sent.add(message_key(a))
                ptr[r] += 1
                progressed = True
        if all(ptr[r] == len(acts) for r, acts in enumerate(sch.actions)):
            return
        if not progressed:
            blocked = [r for r in range(sch.p) if ptr[r] < len(sch.actions[r])]
            waits = "; ".join(f"rank {r} waits at action {ptr[r]} {sch.actions[r][ptr[r]]}" for r in blocked)
            r = blocked[0]
            raise ScheduleError(r, ptr[r], "deadlock", f"no rank can proceed: {waits}")


def _stash(sch: Schedule, split: bool) -> tuple[int, ...]:
    peaks = []
    for r, acts in enumerate(sch.actions):
        held = peak = 0
        for k, a in enumerate(acts):
            if a.kind == "F":
                held += 1
            elif is_last_backward(a, split):
                held -= 1
            if held > peak:
                peak = held
                if peak > sch.stash_bound[r]:
                    raise ScheduleError(
                        r, k, "stash",
                        f"{a} brings the rank to {peak} stashed activations, over its bound {sch.stash_bound[r]}",
                    )
        peaks.append(peak)
    return tuple(peaks)


def _weight_versions(sch: Schedule, split: bool) -> tuple[int, ...]:
    """Walk each stage's actions. Version ``k`` is the weights after ``k`` updates; stage ``s``
    applies step ``t``'s update right after its last backward of step ``t``."""
    peaks = []
    for s in range(sch.stages):
        r = sch.rank_of(s)
        acts = [(k, a) for k, a in enumerate(sch.actions[r]) if a.stage == s and a.kind in ("F", "B", "I", "W")]
        last_of_step: dict[int, int] = {}
        for k, a in acts:
            if is_last_backward(a, split):
                last_of_step[a.microbatch // sch.m] = k
        updates, peak = 0, 1
        in_flight: dict[int, int] = {}  # micro-batch -> version its forward used
        for k, a in acts:
            t = a.microbatch // sch.m
            if a.kind == "F":
                if sch.weight_rule == "delay1":
                    version = max(t - 1, 0)
                    if updates < version:
                        raise ScheduleError(
                            r, k, "weight-versions",
                            f"{a} of step {t} needs the weights after step {t - 2}'s update, "
                            f"which stage {s} has not applied",
                        )
                else:
                    version = updates
                in_flight[a.microbatch] = version
                live = len(set(in_flight.values()) | {updates})
                peak = max(peak, live)
            elif is_last_backward(a, split):
                del in_flight[a.microbatch]
                if last_of_step[t] == k:
                    if updates != t:
                        raise ScheduleError(
                            r, k, "weight-versions", f"stage {s} finishes step {t} before step {updates}"
                        )
                    updates += 1
                    peak = max(peak, len(set(in_flight.values()) | {updates}))
            if peak > sch.weight_versions[s]:
                raise ScheduleError(
                    r, k, "weight-versions",
                    f"stage {s} holds {peak} weight versions at {a}, over its bound {sch.weight_versions[s]}",
                )
        peaks.append(peak)
    return tuple(peaks)
