"""Deadlines in the cluster service (issue 17): what earliest-deadline-first admission buys.

SIMULATED in virtual time with the service's own decision code, not a physical run: every round
the service's ``Scheduler`` (policy + round mechanism + ``diff_actions``, as in
``virtualflow.service.runner``) places the jobs, then ``virtualflow.service.deadlines.admit``
(the admission the service applies) may change the placements; each placed job then progresses
at its true rate on its (type, workers) for the round, minus a change cost (``START_S`` for a
start, resume or move, ``RESIZE_S`` for an in-place resize). The scheduler sees the true rates
(as its estimates after a job's first measured rounds). The baseline is the same policy without
admission, in the same run.

Trace: ``--jobs`` jobs (default 40; seeds ``--seeds``), Poisson arrivals (mean gap ``--gap-s``,
300 s: an offered load of about 0.9 of the cluster's V100-equivalent capacity, so jobs queue in
bursts), each a
rigid job of 1 or 2 workers or an elastic 1-2 one, a per-worker speed drawn in [0.5, 2] steps/s,
sub-linear scaling (``workers ** 0.9``), 2 to 25 minutes of work on one V100; half of them with a
deadline = arrival + ``U(1.3, 3)`` x their time alone on their best placement. Cluster:
``v100=2,k80=2`` (a K80 3x slower), rounds of 60 s.

Reported per policy (fifo, las, elastic_fair): deadlines met without and with admission, the
average JCT of the jobs without a deadline (what the others pay) and of all jobs; the decision
time of ``admit`` with 100 queued jobs.

Targets: with admission at least as many deadlines met as without, under every policy and in
total strictly more (key ``deadlines_met_gain``, the total gain in met deadlines, >= 1); the
admission's decision time at 100 queued jobs <= 20 ms (key ``admit_s``).

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.service_deadlines           # about a minute
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.service_deadlines --quick   # one seed
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench import harness as H
from virtualflow.cluster.policies.base import get_policy
from virtualflow.service.core import JobView, RoundDecision, Scheduler, diff_actions, prior_rate
from virtualflow.service.deadlines import admit

NAME = "service_deadlines"
TARGET_KEYS = ("deadlines_met_gain", "admit_s")
SLOTS = {"v100": 2, "k80": 2}
SLOWDOWN = {"v100": 1.0, "k80": 3.0}
ROUND_S = 60.0
START_S = 10.0
RESIZE_S = 2.0
POLICIES = ("fifo", "las", "elastic_fair")


@dataclass
class Job:
    id: int
    arrival: float
    steps: int
    elastic: bool
    lo: int
    hi: int
    base: float
    deadline: float | None
    done: float = 0.0
    finish: float | None = None
    slots: tuple[str, ...] = ()
    received: dict | None = None

    def rate(self, t: str, n: int) -> float:
        return self.base * n ** 0.9 / SLOWDOWN[t]

    def estimates(self) -> dict[str, float]:
        return {f"{t}/{n}": self.rate(t, n) for t in SLOTS for n in range(1, self.hi + 1) if n <= SLOTS[t]}


def trace(n: int, seed: int, gap_s: float = 300.0) -> list[Job]:
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for i in range(1, n + 1):
        t += rng.expovariate(1 / gap_s)
        kind = rng.choice(("rigid1", "rigid2", "elastic"))
        lo, hi, elastic = (1, 1, False) if kind == "rigid1" else (2, 2, False) if kind == "rigid2" else (1, 2, True)
        base = rng.uniform(0.5, 2.0)
        steps = int(base * rng.uniform(120, 1500))
        j = Job(i, t, steps, elastic, lo, hi, base, None, received={})
        if rng.random() < 0.5:
            alone = steps / max(j.rate("v100", n) for n in range(lo, hi + 1))
            j.deadline = t + rng.uniform(1.3, 3.0) * alone
        jobs.append(j)
    return jobs


def view(j: Job) -> JobView:
    running = (j.slots[0].rpartition("-")[0], len(j.slots)) if j.slots else None
    return JobView(job_id=j.id, steps=j.steps, steps_done=int(j.done), elastic=j.elastic, min_workers=j.lo,
                   max_workers=j.hi, arrival_s=j.arrival, slowdowns=dict(SLOWDOWN), estimates=j.estimates(),
                   received_s=dict(j.received), running=running, slots=j.slots)


def simulate(jobs: list[Job], policy: str, with_admission: bool) -> dict:
    sched = Scheduler(SLOTS, get_policy(policy), round_s=ROUND_S)
    now, admitted = 0.0, 0
    while any(j.finish is None for j in jobs):
        active = [j for j in jobs if j.arrival <= now and j.finish is None]
        if not active:
            now = min(j.arrival for j in jobs if j.finish is None)
            continue
        views = [view(j) for j in active]
        decision: RoundDecision = sched.plan(views, now)
        if with_admission:
            placed = {jid: (s[0].rpartition("-")[0], len(s)) for jid, s in decision.slots.items() if s}
            adm = admit(views, placed, {j.id: j.deadline for j in active if j.deadline is not None}, now_s=now,
                        round_s=ROUND_S, slots=SLOTS, prior=prior_rate(views))
            if adm.swaps:
                admitted += len(adm.swaps)
                actions, slots = diff_actions(views, adm.placements, SLOTS)
                decision = RoundDecision(decision.plan, actions, slots, decision.solved, decision.decision_s)
        cost = {a.job_id: (RESIZE_S if a.kind == "resize" else START_S) for a in decision.actions
                if a.kind in ("start", "restart", "resize")}
        by_id = {j.id: j for j in active}
        for j in active:
            j.slots = tuple(decision.slots.get(j.id, ()))
            if not j.slots:
                continue
            t, n = j.slots[0].rpartition("-")[0], len(j.slots)
            j.received[t] = j.received.get(t, 0.0) + ROUND_S
            work_s = ROUND_S - cost.get(j.id, 0.0)
            r = j.rate(t, n)
            left = j.steps - j.done
            if r * work_s >= left:
                j.finish = now + cost.get(j.id, 0.0) + left / r
                j.done = j.steps
                j.slots = ()
                sched.finished(j.id)
            else:
                j.done += r * work_s
        sched.end_round()
        now += ROUND_S
        assert now < 1e7 and by_id
    due = [j for j in jobs if j.deadline is not None]
    free = [j for j in jobs if j.deadline is None]
    return {"policy": policy, "admission": with_admission, "deadline_jobs": len(due),
            "met": sum(j.finish <= j.deadline for j in due),
            "avg_jct_no_deadline_s": statistics.mean(j.finish - j.arrival for j in free) if free else 0.0,
            "avg_jct_s": statistics.mean(j.finish - j.arrival for j in jobs),
            "admissions": admitted, "makespan_s": max(j.finish for j in jobs)}


def admit_time(n: int = 100, reps: int = 20) -> float:
    """Median seconds of one ``admit`` with ``n`` queued jobs (half with tight deadlines) and a
    full cluster."""
    jobs = trace(n, 99)
    now = max(j.arrival for j in jobs)
    for j in jobs:
        if j.deadline is not None:
            j.deadline = now + 0.9 * j.steps / j.rate("v100", j.hi) + 30.0  # urgent
    views = [view(j) for j in jobs]
    placed = {jobs[0].id: ("v100", 2), jobs[1].id: ("k80", 2)}
    deadlines = {j.id: j.deadline for j in jobs if j.deadline is not None}
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        admit(views, placed, deadlines, now_s=now, round_s=ROUND_S, slots=SLOTS, prior=1.0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__)
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--gap-s", type=float, default=300.0, help="mean seconds between arrivals (300)")
    args = p.parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    seeds = 1 if args.quick else args.seeds
    print(H.banner("service_deadlines: earliest-deadline-first admission (SIMULATED, virtual time)"), flush=True)
    rows, results = [], []
    for policy in POLICIES:
        agg = {}
        for adm in (False, True):
            rs = [simulate(trace(args.jobs, seed, args.gap_s), policy, adm) for seed in range(seeds)]
            results += [{**r, "seed": s} for s, r in enumerate(rs)]
            agg[adm] = {"met": sum(r["met"] for r in rs), "due": sum(r["deadline_jobs"] for r in rs),
                        "jct_free": statistics.mean(r["avg_jct_no_deadline_s"] for r in rs),
                        "jct": statistics.mean(r["avg_jct_s"] for r in rs),
                        "admissions": sum(r["admissions"] for r in rs)}
        a, b = agg[False], agg[True]
        rows.append([policy, f"{a['met']}/{a['due']}", f"{b['met']}/{b['due']}", b["admissions"],
                     f"{a['jct_free']:.0f}", f"{b['jct_free']:.0f}", f"{b['jct_free'] / a['jct_free']:.2f}",
                     f"{a['jct']:.0f}", f"{b['jct']:.0f}"])
        run.targets.holds(f"{policy}: deadlines met with admission >= without", b["met"] >= a["met"],
                          f"{b['met']} vs {a['met']} of {a['due']}")
    gain = sum(int(r[2].split("/")[0]) - int(r[1].split("/")[0]) for r in rows)
    run.targets.at_least("deadlines_met_gain", "deadlines met, gained in total over the policies", gain,
                         run.targets.limit("deadlines_met_gain", 1))
    t_admit = admit_time()
    run.targets.at_most("admit_s", "admit() with 100 queued jobs", t_admit, run.targets.limit("admit_s", 0.02), "s")
    header = ["policy", "met without", "met with", "rounds admitted", "avg JCT no-deadline (s) without", "with", "ratio",
              "avg JCT all (s) without", "with"]
    md = (f"# {run.name}: earliest-deadline-first admission in the cluster service\n\n"
          f"SIMULATED in virtual time with the service's own Scheduler and admit() (not a physical run); "
          f"{args.jobs} jobs x {seeds} seed(s), mean arrival gap {args.gap_s:g} s, slots {SLOTS}, K80 3x slower, "
          f"rounds of {ROUND_S:g} s, change "
          f"costs {START_S:g} s (start/move) and {RESIZE_S:g} s (resize); half the jobs have a deadline of "
          f"U(1.3, 3) x their time alone.\n\n" + H.md_table(header, rows)
          + f"\n\nadmit() with 100 queued jobs: {t_admit * 1000:.2f} ms (median of 20).\n\n"
          f"Command: `{run.command(NAME)}`\n\n" + H.env_markdown())
    print(H.text_table(header, rows))
    print(f"admit() with 100 queued jobs: {t_admit * 1000:.2f} ms")
    payload = {"benchmark": run.name, "environment": H.environment(), "quick": args.quick, "jobs": args.jobs,
               "gap_s": args.gap_s,
               "seeds": seeds, "simulated": True, "rows": [dict(zip(header, r)) for r in rows],
               "admit_s_100_jobs": t_admit, "results": results}
    return run.finish(payload, md)


if __name__ == "__main__":
    sys.exit(main())
