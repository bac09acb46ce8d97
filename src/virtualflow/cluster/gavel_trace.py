"""Gavel's own workload generator, re-implemented: the same jobs Gavel's sweep scripts generate.

Gavel (stanford-futuredata/gavel, MIT) does not ship its evaluation traces; its sweeps generate the
jobs on the fly inside the simulator. This module reproduces that job sequence for a given seed, so
a figure measured with Gavel's scripts can be replayed in ``virtualflow simulate`` on the *same*
jobs. It follows, in Gavel's repository:

* ``scheduler/scheduler.py``: ``Scheduler._initialize_seeds`` (one ``random.Random`` per stream:
  job parameters seeded ``seed + 2``, inter-arrival times ``seed + 3``, SLOs ``seed + 6``),
  ``Scheduler.simulate`` (the first job arrives at 0; after each job the next arrival is drawn,
  ``-log(1 - U) * lam`` with ``lam = 3600 / jobs_per_hour``; ``lam = 0`` puts every job at 0 and
  draws nothing) and ``_sample_arrival_time_delta``;
* ``scheduler/utils.py``: ``generate_job`` (draw order: scale factor, then duration, then the job
  type, then the priority, then the SLO), ``_generate_scale_factor``, ``_generate_duration``;
* ``scheduler/job_table.py``: the job-type order (26 templates; ResNet-18, ResNet-50, Transformer
  and LM are the ``distributed`` ones that may take more than one GPU);
* ``scheduler/scripts/sweeps/run_sweep_continuous.py`` (``lam = 3600 / rate``, window of job ids,
  ``--generate-multi-gpu-jobs``) and ``run_sweep_static.py`` (``lam = 0``, ``num_total_jobs``).

What each job gets (all draws from the job stream unless said):

1. scale factor: ``r = U(0, 1)``; 2 if ``.7 <= r <= .8``, 4 if ``.8 < r <= .95``, 8 if ``r > .95``,
   else 1 (drawn even when multi-GPU jobs are off, then forced to 1);
2. duration: ``60 * 10**U(3, 4)`` s if ``U() >= .8`` else ``60 * 10**U(1.5, 3)`` s;
3. job type: ``choice`` over the 26 templates, redrawn until the scale factor is 1 or the template
   is distributed;
4. priority (``multi_priority``): weight 5 if ``U(0, 1) <= .2`` else 1;
5. SLO (``slos``, SLO stream): 1.2 / 2.0 / 10.0 x the duration for ``r < .33`` / ``< .67`` / else;
6. total steps = duration x the job's throughput on ``scale_factor`` V100s (Gavel's
   ``throughputs['v100'][(type, scale)]['null']``): the duration is the run time on its own GPUs of
   the reference type.

Invariants: job ids are 0..n-1 in generation (= arrival) order; the result depends only on the
arguments (Python's ``random.Random``, which Gavel uses, is stable across Python versions for
``random()``, ``uniform`` and ``choice``); job ``i`` is the same whatever ``num_jobs`` (> i) is.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from virtualflow.cluster.model import JobSpec
from virtualflow.cluster.throughputs import ThroughputTable

__all__ = ["GAVEL_JOB_TYPES", "GavelTraceConfig", "generate_gavel_jobs"]


def _table() -> tuple[tuple[str, bool], ...]:
    rows: list[tuple[str, bool]] = []
    rows += [(f"ResNet-18 (batch size {b})", True) for b in (16, 32, 64, 128, 256)]
    rows += [(f"ResNet-50 (batch size {b})", True) for b in (16, 32, 64, 128)]
    rows += [(f"Transformer (batch size {b})", True) for b in (16, 32, 64, 128, 256)]
    rows += [(f"LM (batch size {b})", True) for b in (5, 10, 20, 40, 80)]
    rows += [(f"Recommendation (batch size {b})", False) for b in (512, 1024, 2048, 4096, 8192)]
    rows += [("A3C", False), ("CycleGAN", False)]
    return tuple(rows)


GAVEL_JOB_TYPES: tuple[tuple[str, bool], ...] = _table()
"""Gavel's ``JobTable`` in its order: (model name, may run on more than one GPU)."""


@dataclass(kw_only=True, slots=True)
class GavelTraceConfig:
    """The knobs of Gavel's sweep scripts that shape the job sequence."""

    num_jobs: int = 800
    """How many jobs to generate (Gavel's continuous sweep generates until its window is done:
    generate enough that arrivals continue past the window's last completion)."""
    rate_per_hour: float = 2.0
    """Arrival rate, jobs per hour (Gavel's ``lam = 3600 / rate``); 0: every job at time 0 (the
    static sweep)."""
    seed: int = 0
    """Gavel's ``--seeds`` value."""
    multi_gpu: bool = True
    """``--generate-multi-gpu-jobs``: scale factors 1/2/4/8 (else every job takes one GPU)."""
    multi_priority: bool = False
    """``--generate-multi-priority-jobs``: a fifth of the jobs get weight 5."""
    slos: bool = False
    """``--assign_SLOs``: each job gets an SLO of 1.2, 2 or 10 x its duration."""
    reference_type: str = "v100"
    """Accelerator type whose throughput turns a duration into steps (Gavel: ``'v100'``)."""
    fixed_duration_s: float | None = None
    """``--fixed-job-duration``: every job runs this long on its reference GPUs."""

    def __post_init__(self) -> None:
        if isinstance(self.num_jobs, bool) or not isinstance(self.num_jobs, int) or self.num_jobs < 1:
            raise ValueError(f"num_jobs={self.num_jobs!r} must be an integer >= 1")
        if not (self.rate_per_hour >= 0 and math.isfinite(self.rate_per_hour)):
            raise ValueError(f"rate_per_hour={self.rate_per_hour} must be a finite number >= 0 (0: every job "
                             "at time 0, Gavel's static sweep)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        if self.fixed_duration_s is not None and not (self.fixed_duration_s > 0 and
                                                      math.isfinite(self.fixed_duration_s)):
            raise ValueError(f"fixed_duration_s={self.fixed_duration_s} must be a finite number > 0 (or None)")


def _scale_factor(u: float) -> int:
    # Gavel's _generate_scale_factor: inclusive bounds, tested in this order.
    if 0.7 <= u <= 0.8:
        return 2
    if 0.8 <= u <= 0.95:
        return 4
    if 0.95 <= u:
        return 8
    return 1


def _slo_multiplier(u: float) -> float:
    if u < 0.33:
        return 1.2
    if u < 0.67:
        return 2.0
    return 10.0


def generate_gavel_jobs(table: ThroughputTable, config: GavelTraceConfig | None = None, **kw) -> list[JobSpec]:
    """Gavel's job sequence for ``config`` (keyword arguments build one), as ``JobSpec``s.

    Raises ``ValueError`` when the throughput table lacks a job type Gavel draws at its scale
    factor on ``reference_type`` (use Gavel's ``simulation_throughputs.json``, the default table).
    """
    if config is not None and kw:
        raise ValueError("pass either a GavelTraceConfig or keyword arguments, not both")
    cfg = config if config is not None else GavelTraceConfig(**kw)
    jobs_rng = random.Random()
    jobs_rng.seed(cfg.seed + 2)
    arrivals_rng = random.Random()
    arrivals_rng.seed(cfg.seed + 3)
    slo_rng = random.Random()
    slo_rng.seed(cfg.seed + 6)
    lam_s = 3600.0 / cfg.rate_per_hour if cfg.rate_per_hour > 0 else 0.0
    known = set(table.job_types)
    missing = sorted(name for name, _ in GAVEL_JOB_TYPES if name not in known)
    if missing:
        raise ValueError(f"the throughput table lacks Gavel's job types {missing[:3]}{' ...' if len(missing) > 3 else ''}; "
                         "the Gavel generator draws from Gavel's job table: use Gavel's simulation_throughputs.json "
                         "(--throughputs, default)")
    jobs: list[JobSpec] = []
    arrival = 0.0
    for i in range(cfg.num_jobs):
        scale = _scale_factor(jobs_rng.uniform(0, 1))
        if cfg.fixed_duration_s is not None:
            duration = float(cfg.fixed_duration_s)
        elif jobs_rng.random() >= 0.8:
            duration = 60 * (10 ** jobs_rng.uniform(3, 4))
        else:
            duration = 60 * (10 ** jobs_rng.uniform(1.5, 3))
        if not cfg.multi_gpu:
            scale = 1
        while True:
            name, distributed = jobs_rng.choice(GAVEL_JOB_TYPES)
            if scale == 1 or distributed:
                break
        try:
            thr = table.throughput(name, cfg.reference_type, scale)
        except (KeyError, ValueError):
            thr = float("nan")
        if not thr > 0:
            raise ValueError(f"job {i}: the throughput table has no throughput for {name!r} on {scale} "
                             f"{cfg.reference_type!r} GPUs (reference_type={cfg.reference_type!r}); Gavel's "
                             "generator needs one for every job type it draws")
        weight = 1.0
        if cfg.multi_priority and jobs_rng.uniform(0, 1) <= 0.2:
            weight = 5.0
        slo_s = _slo_multiplier(slo_rng.uniform(0, 1)) * duration if cfg.slos else None
        jobs.append(JobSpec(job_id=i, job_type=name, scale_factor=scale, total_steps=duration * thr,
                            weight=weight, slo_s=slo_s, arrival_s=arrival))
        if lam_s > 0:
            arrival = -math.log(1.0 - arrivals_rng.random()) / (1.0 / lam_s) + arrival
    return jobs
