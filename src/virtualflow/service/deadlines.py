"""Job deadlines in the cluster service, pure: no processes, no clock (times are passed in).

A job may be submitted with a deadline (``virtualflow submit --deadline 30m``): an absolute time
(seconds since the epoch, :func:`parse_deadline`) stored with the job. Three things follow.

1. **Slack.** The service estimates each deadline job's time to finish, ``eta_s`` = steps left /
   its estimated steps/s (:func:`eta_s`: on what it runs on now; a queued job on the best
   placement it could get, since it makes no progress while it waits), with the same estimates
   the scheduler uses (:func:`virtualflow.service.core.estimate`: measured where measured,
   extrapolated elsewhere). ``slack = (deadline - now) - eta``: how much later it could finish
   and still make it. ``virtualflow queue`` and the dashboard show both.
2. **Missed deadlines.** A job still unfinished when its deadline passes gets one
   ``deadline_missed`` event (:func:`newly_missed`); it keeps running (its deadline is a wish,
   not a kill switch).
3. **Earliest-deadline-first admission** (:func:`admit`), applied each round after the policy
   and the round mechanism have placed jobs. A deadline job is **urgent** when what the policy
   planned for it this round misses its deadline (it left the job out, or placed it on too slow a
   placement), it could still make its deadline if it ran well from now on (on some type, with a
   worker count it accepts), and it could not if it waited one more round. Urgent jobs, the
   earliest deadline first, take the slots they need: free slots of the type first, then by
   shrinking elastic jobs toward their minimum (in place), then by preempting jobs, always from
   jobs with no deadline or a later one (no deadline first, then the latest deadline, then the
   latest submitted), never from a pinned job (one still starting). The type tried first is the
   one the job runs on now (no move), then the fastest for it, each with the fewest workers that
   make the deadline. A job that can no longer make its deadline gets no priority (it runs when
   the policy places it), nor does one the policy placed well enough. Otherwise the policy
   decides as it would without deadlines.

Invariants: :func:`admit` never places more workers of a type than the type has slots, never
changes a pinned job's placement, only ever takes slots from jobs whose deadline is later than
the urgent job's (or that have none), and the same inputs give the same decision.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable

from virtualflow.service.core import JobView, estimate

__all__ = ["parse_deadline", "format_duration", "eta_s", "slack_s", "deadline_cells", "newly_missed", "Swap",
           "Admission", "admit"]

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_deadline(text: str, now_s: float) -> float:
    """``--deadline``: a duration after ``now_s`` (``90`` or ``90s`` seconds, ``30m``, ``2h``,
    ``1h30m``, ``1d``) or an ISO 8601 time (``2026-11-25T18:00``, ``2026-11-25 18:00:00+01:00``;
    without a zone: this machine's local time). Returns the deadline in seconds since the epoch;
    a deadline that is not after ``now_s`` or that cannot be read is a ``ValueError``."""
    raw = text
    text = text.strip()
    example = "e.g. --deadline 30m, 2h, 1h30m, 5400 (seconds) or 2026-11-25T18:00"
    if not text:
        raise ValueError(f"--deadline {raw!r} is empty; {example}")
    m = _DURATION.match(text.lower().replace(" ", ""))
    if m and any(m.groups()):
        d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        after = d * 86400 + h * 3600 + mi * 60 + s
    elif re.fullmatch(r"\d+(?:\.\d+)?", text):
        after = float(text)
    else:
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"--deadline {raw!r} is neither a duration nor an ISO time; {example}") from None
        at = when.timestamp()  # a naive time is this machine's local time
        if not at > now_s:
            raise ValueError(f"--deadline {raw!r} ({when.isoformat()}) is not in the future (now is "
                             f"{datetime.fromtimestamp(now_s).astimezone().isoformat(timespec='seconds')}); give a "
                             f"later time or a duration such as 30m")
        return at
    if not (math.isfinite(after) and after > 0):
        raise ValueError(f"--deadline {raw!r} must be a positive duration after submission; {example}")
    return now_s + after


def format_duration(seconds: float | None) -> str:
    """``3725`` -> ``"1h02m"``, ``-190`` -> ``"-3m10s"``, ``None`` -> ``"-"`` (for tables)."""
    if seconds is None or not math.isfinite(seconds):
        return "-" if seconds is None or math.isnan(seconds) else ("inf" if seconds > 0 else "-inf")
    sign = "-" if seconds < 0 else ""
    s = int(round(abs(seconds)))
    if s >= 86400:
        return f"{sign}{s // 86400}d{(s % 86400) // 3600:02d}h"
    if s >= 3600:
        return f"{sign}{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{sign}{s // 60}m{s % 60:02d}s"
    return f"{sign}{s}s"


def _options(view: JobView, slots: dict[str, int]) -> list[tuple[str, int]]:
    """Every (type, workers) the job accepts: rigid jobs exactly ``max_workers``."""
    counts = range(view.min_workers, view.max_workers + 1) if view.elastic else (view.max_workers,)
    return [(t, n) for t in slots if t in view.slowdowns for n in counts if 1 <= n <= slots[t]]


def eta_s(view: JobView, slots: dict[str, int], prior: float) -> float | None:
    """Estimated seconds for the job to finish: on what it runs on now, or (queued) on its best
    placement; ``None`` when it has nowhere to run."""
    left = max(view.steps - view.steps_done, 0)
    if left == 0:
        return 0.0
    if view.running is not None:
        rate = estimate(view, view.running[0], view.running[1], prior)
        return left / rate if rate > 0 else None
    rates = [estimate(view, t, n, prior) for t, n in _options(view, slots)]
    best = max(rates, default=0.0)
    return left / best if best > 0 else None


def slack_s(deadline_s: float | None, now_s: float, eta: float | None) -> float | None:
    """Time left before the deadline minus the estimated time to finish (None without either)."""
    if deadline_s is None or eta is None:
        return None
    return deadline_s - now_s - eta


def deadline_cells(job: Any, now_s: float) -> tuple[str, str]:
    """(deadline, slack) of a job in a table (``virtualflow queue``, the dashboard), from its
    database row (``deadline_s``, ``state``, ``finished_s``, ``deadline_missed``, ``eta_s``): the
    time left before the deadline (``missed`` once it passed unfinished; ``met 2m10s`` /
    ``missed 40s`` for a finished job, by how much) and the slack, time left minus the service's
    estimated time to finish; ``-`` where there is none."""
    if job.deadline_s is None:
        return "-", "-"
    if job.state in ("done", "failed", "cancelled"):
        if job.state != "done" or job.finished_s is None:
            return ("missed" if job.deadline_missed else "-"), "-"
        early = job.deadline_s - job.finished_s
        return ("met " if early >= 0 else "missed ") + format_duration(abs(early)), "-"
    left = job.deadline_s - now_s
    return ("missed" if left < 0 else format_duration(left)), format_duration(slack_s(job.deadline_s, now_s, job.eta_s))


def newly_missed(jobs: Iterable[tuple[int, float | None, bool]], now_s: float) -> list[int]:
    """The ids of unfinished jobs ``(job id, deadline_s, already recorded missed)`` whose deadline
    has passed at ``now_s`` and that were not recorded yet: one ``deadline_missed`` event each."""
    return [jid for jid, deadline, flagged in jobs if deadline is not None and not flagged and now_s > deadline]


@dataclass(frozen=True, slots=True)
class Swap:
    """One urgent job placed by :func:`admit`, and what it took from whom."""

    job_id: int
    acc_type: str
    workers: int
    deadline_s: float
    slack_s: float
    """Its slack on this placement, from now."""
    shrunk: tuple[tuple[int, int, int], ...] = ()
    """(job id, workers before, workers after) of elastic jobs shrunk in place."""
    preempted: tuple[int, ...] = ()
    planned: tuple[str, int] | None = None
    """What the policy had planned for it (None: nothing; else a placement too slow for it)."""


@dataclass(slots=True)
class Admission:
    """:func:`admit`'s answer."""

    placements: dict[int, tuple[str, int]]
    """Job id -> (type, workers) after the admissions (all of the input's, changed where said)."""
    swaps: list[Swap] = field(default_factory=list)
    urgent: list[int] = field(default_factory=list)
    """Every urgent job, earliest deadline first (placed or not: see ``swaps``)."""


def _victim_order(jid: int, deadlines: dict[int, float]) -> tuple[int, float, int]:
    d = deadlines.get(jid)
    return (0 if d is None else 1, -(d if d is not None else 0.0), -jid)


def admit(views: list[JobView], placements: dict[int, tuple[str, int]], deadlines: dict[int, float], *,
          now_s: float, round_s: float, slots: dict[str, int], pinned: set[int] | frozenset[int] = frozenset(),
          prior: float) -> Admission:
    """Earliest-deadline-first admission over a round's ``placements`` (job id -> (type, workers),
    what the policy and the mechanism placed; see the module docstring). ``deadlines``: job id ->
    deadline (seconds, the clock of ``now_s``); ``prior``: the per-worker rate of a job not
    measured yet (:func:`virtualflow.service.core.prior_rate`)."""
    out = dict(placements)
    by_id = {v.job_id: v for v in views}
    used = {t: 0 for t in slots}
    for t, n in out.values():
        used[t] = used.get(t, 0) + n
    urgent: list[tuple[float, int, list[tuple[str, int, float]]]] = []
    for v in views:
        d = deadlines.get(v.job_id)
        if d is None or v.steps_done >= v.steps or v.job_id in pinned:
            continue
        left = v.steps - v.steps_done

        def slack(t: str, n: int) -> float:
            rate = estimate(v, t, n, prior)
            return d - now_s - left / rate if rate > 0 else -math.inf

        options = [(t, n, slack(t, n)) for t, n in _options(v, slots)]  # slack if it ran there from now on
        best = max((s for _, _, s in options), default=-math.inf)
        planned = slack(*out[v.job_id]) if v.job_id in out else -math.inf  # waiting: -inf
        # It makes its deadline if it runs well from now on, would not after waiting a round, and
        # what the policy planned for it (nothing, or too slow a placement) misses it.
        if 0 <= best < round_s and planned < 0:
            urgent.append((d, v.job_id, [o for o in options if o[2] >= 0]))
    urgent.sort()
    swaps: list[Swap] = []
    for d, jid, feasible in urgent:
        v = by_id[jid]
        here = v.running[0] if v.running is not None else None
        planned = out.pop(jid, None)  # too slow a placement is given up if a better one is found
        if planned is not None:
            used[planned[0]] -= planned[1]
        speed = {t: max(estimate(v, t, n, prior) for tt, n, _ in feasible if tt == t) for t, _, _ in feasible}
        for t in sorted(speed, key=lambda t: (t != here, -speed[t], t)):
            need = min(n for tt, n, _ in feasible if tt == t)  # the fewest workers that make it
            free = slots[t] - used[t]
            victims = sorted((j for j, (tt, _) in out.items() if tt == t and j not in pinned and j != jid
                              and (deadlines.get(j) is None or deadlines[j] > d)),
                             key=lambda j: _victim_order(j, deadlines))
            shrink: list[tuple[int, int, int]] = []
            preempt: list[int] = []
            for j in victims:  # in place first: elastic jobs down to their minimum
                if free >= need:
                    break
                vj, n = by_id.get(j), out[j][1]
                if vj is not None and vj.elastic and n > vj.min_workers:
                    to = max(vj.min_workers, n - (need - free))
                    shrink.append((j, n, to))
                    free += n - to
            for j in victims:
                if free >= need:
                    break
                n = next((to for s, _, to in shrink if s == j), out[j][1])
                preempt.append(j)
                free += n
            if free < need:
                continue  # not enough on this type even so: try the next
            for j, before, to in shrink:
                if j not in preempt:
                    out[j] = (t, to)
                    used[t] -= before - to
            for j in preempt:
                used[t] -= out.pop(j)[1]
            shrink = [s for s in shrink if s[0] not in preempt]
            out[jid] = (t, need)
            used[t] += need
            slack = next(s for tt, n, s in feasible if tt == t and n == need)
            swaps.append(Swap(jid, t, need, d, slack, tuple(shrink), tuple(preempt), planned))
            break
        else:
            if planned is not None:  # nowhere better: it keeps what the policy planned
                out[jid] = planned
                used[planned[0]] += planned[1]
    return Admission(out, swaps, [jid for _, jid, _ in urgent])

