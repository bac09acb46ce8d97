"""Job traces for the cluster simulator: Gavel's TSV format and a seeded workload generator.

Gavel's trace format (examples ship with the package: ``gavel_trace_path("small_test")``) has one
job per line, tab-separated::

    job_type  command  working_directory  num_steps_arg  needs_data_dir  total_steps
    scale_factor  [priority_weight  [SLO  [arrival_time]]]

``command``, ``working_directory``, ``num_steps_arg`` and ``needs_data_dir`` only matter to a real
deployment and are checked for presence, not used. Missing trailing columns take their defaults
(weight 1, no SLO, arrival 0). An SLO column <= 0 (Gavel writes ``-1.000000``) means "no SLO"; a
positive value is a multiplier of the job's isolated run time on ``reference_type`` at its own
scale (Gavel's convention), converted here to an absolute ``slo_s`` (seconds after arrival).

The generator draws Gavel's continuous workload:

* arrivals: a Poisson process of ``rate_per_hour`` jobs per hour (the first job arrives at 0);
* durations: ``10**U(1.5, 3)`` minutes with probability 0.8, else ``10**U(3, 4)`` minutes;
* GPU counts 1/2/4/8 with probabilities .70/.10/.15/.05;
* job type: uniform over the table's types that have a throughput at that GPU count;
* total steps = duration x throughput on one ``reference_type`` GPU (``steps_reference="one"``,
  the issue's definition) or on ``scale_factor`` of them (``"scale"``, what Gavel's own
  generator does; it makes multi-GPU jobs longer).

``parse_generate_spec("gavel:rate=2.0,jobs=800,seed=0")`` instead gives the exact job sequence of
Gavel's own scripts for that seed (:mod:`virtualflow.cluster.gavel_trace`).

virtualflow's own JSON trace (:func:`read_json_trace`, :func:`write_json_trace`) carries what
Gavel's format cannot: elastic ranges, absolute SLOs and any job type the throughput table
names::

    {"jobs": [{"job_type": "job-0", "total_steps": 120, "scale_factor": 2, "min_gpus": 1,
               "weight": 1.0, "arrival_s": 0.0, "slo_s": null}, ...]}

(``min_gpus``, ``weight``, ``arrival_s``, ``slo_s`` optional: rigid, 1, 0, none; so are a job's
batch fields ``batch_size``, ``vn_size``, ``batch_size_range`` and ``lr_rule``, see ``JobSpec``).
``virtualflow cluster replay --export`` writes one for a cluster's finished run.

Invariants: job ids are 0..n-1 in trace order; the same seed and arguments give the same jobs
(one ``numpy.random.Generator``, draws in a fixed order); every error names the file and line.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from virtualflow.cluster import bounds
from virtualflow.cluster.gavel_trace import GavelTraceConfig, generate_gavel_jobs
from virtualflow.cluster.model import JobSpec
from virtualflow.cluster.throughputs import ThroughputTable

__all__ = ["read_gavel_trace", "write_gavel_trace", "read_json_trace", "write_json_trace", "GeneratorConfig",
           "generate_jobs", "parse_generate_spec", "draw_duration_s"]

MAX_JOBS = 1_000_000
"""Jobs one generated workload may have."""
MAX_RATE_PER_HOUR = 1e6
_MIN_COLUMNS = 7
_MAX_COLUMNS = 10
SCALE_CHOICES = (1, 2, 4, 8)
SCALE_PROBS = (0.70, 0.10, 0.15, 0.05)


def _has_throughput(table: ThroughputTable, job_type: str, acc_type: str, scale: int) -> bool:
    try:
        return table.throughput(job_type, acc_type, scale) > 0
    except (KeyError, ValueError):
        return False


def _isolated_time_s(table: ThroughputTable, job_type: str, scale: int, total_steps: float,
                     reference_type: str) -> float:
    thr = table.throughput(job_type, reference_type, scale)
    return total_steps / thr


def check_job(where: str, table: ThroughputTable, job_type: str, total_steps: float, scale: int) -> None:
    """A job's steps bounded by what they mean: the job must finish alone on its fastest
    accelerator type, at its own scale, within :data:`bounds.MAX_JOB_RUN_S` (a longer one would
    keep the simulation running for ever: 1e300 steps never finish)."""
    best = 0.0
    for t in table.acc_types:
        try:
            best = max(best, table.throughput(job_type, t, scale))
        except (KeyError, ValueError):
            continue
    if best > 0 and total_steps / best > bounds.MAX_JOB_RUN_S:
        raise ValueError(f"{where}: total_steps={total_steps:g} would take {total_steps / best / 3600:.3g} h alone on "
                         f"its fastest GPU type ({best:g} steps/s at scale {scale}); a job may run at most "
                         f"{bounds.MAX_JOB_RUN_S / 3600:.0f} h (one year)")


def read_gavel_trace(path: str | os.PathLike, table: ThroughputTable, *, reference_type: str = "v100") -> list[JobSpec]:
    """Parse a Gavel ``.trace`` file into ``JobSpec``s (ids 0..n-1 in line order; blank lines skipped).

    Raises ``ValueError("FILE:LINE: ...")`` for a malformed line (wrong column count, a number that
    does not parse or is out of the bounds of :mod:`virtualflow.cluster.bounds`) or a job type the
    throughput table does not know, and
    ``ValueError("FILE: ...")`` for a file that is not UTF-8 text or holds no job.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a Gavel trace (byte {exc.start} is not UTF-8 text)") from None
    known = set(table.job_types)
    jobs: list[JobSpec] = []
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        cols = line.split("\t")
        if not _MIN_COLUMNS <= len(cols) <= _MAX_COLUMNS:
            raise ValueError(f"{where}: expected {_MIN_COLUMNS} to {_MAX_COLUMNS} tab-separated columns "
                             f"(job_type, command, working_directory, num_steps_arg, needs_data_dir, "
                             f"total_steps, scale_factor[, priority_weight[, SLO[, arrival_time]]]), "
                             f"got {len(cols)}")
        job_type = cols[0].strip()
        if job_type not in known:
            raise ValueError(f"{where}: unknown job type {job_type!r}; the throughput table knows "
                             f"{sorted(known)}")

        def num(i: int, name: str) -> float:
            try:
                v = float(cols[i])
            except ValueError:
                raise ValueError(f"{where}: column {i + 1} ({name}) = {cols[i]!r} is not a number") from None
            if not math.isfinite(v):
                raise ValueError(f"{where}: column {i + 1} ({name}) = {cols[i]!r} is not finite")
            return v

        total_steps = bounds.number(num(5, "total_steps"), where=where, field="total_steps", lo=0, lo_open=True,
                                    hi=bounds.MAX_STEPS, meaning="a job's steps")
        scale = bounds.number(num(6, "scale_factor"), where=where, field="scale_factor", lo=1,
                              hi=bounds.MAX_GPUS_PER_JOB, integral=True, meaning="GPUs of a job")
        weight = (bounds.number(num(7, "priority_weight"), where=where, field="priority_weight", lo=0, lo_open=True,
                                hi=bounds.MAX_WEIGHT, meaning="a job's priority") if len(cols) > 7 else 1.0)
        slo = num(8, "SLO") if len(cols) > 8 else -1.0
        if slo > 0:
            bounds.number(slo, where=where, field="SLO", lo=0, hi=1e6,
                          meaning="a multiple of the job's isolated run time")
        arrival = (bounds.number(num(9, "arrival_time"), where=where, field="arrival_time", lo=0,
                                 hi=bounds.MAX_SIM_S, meaning="seconds into the trace, ten years at most")
                   if len(cols) > 9 else 0.0)
        if not any(_has_throughput(table, job_type, t, scale) for t in table.acc_types):
            raise ValueError(f"{where}: the throughput table has no throughput for {job_type!r} at "
                             f"scale_factor={scale} on any accelerator type")
        check_job(where, table, job_type, total_steps, scale)
        slo_s = None
        if slo > 0:
            if not _has_throughput(table, job_type, reference_type, scale):
                raise ValueError(f"{where}: SLO={slo} is relative to the run time on {reference_type!r}, "
                                 f"which has no throughput for {job_type!r} at scale {scale}")
            slo_s = slo * _isolated_time_s(table, job_type, scale, total_steps, reference_type)
        try:
            jobs.append(JobSpec(job_id=len(jobs), job_type=job_type, scale_factor=scale, total_steps=total_steps,
                                weight=weight, slo_s=slo_s, arrival_s=arrival))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if not jobs:
        raise ValueError(f"{path}: no jobs (the file is empty or every line is blank)")
    return jobs


def write_gavel_trace(path: str | os.PathLike, jobs: Sequence[JobSpec]) -> None:
    """Write jobs as a Gavel trace (10 columns; SLO column -1: absolute SLOs do not round-trip).

    Elastic ranges are not part of Gavel's format: an elastic job is written at its maximum.
    """
    with open(path, "w") as f:
        for j in jobs:
            f.write("\t".join([j.job_type, "-", "-", "-", "0", repr(float(j.total_steps)), str(int(j.scale_factor)),
                               repr(float(j.weight)), "-1", repr(float(j.arrival_s))]) + "\n")


_JSON_KEYS = {"job_type", "total_steps", "scale_factor", "min_gpus", "weight", "arrival_s", "slo_s"}
_BATCH_KEYS = ("batch_size", "vn_size", "batch_size_range", "lr_rule")
"""Optional batch fields of a JSON trace's job (``JobSpec``'s; checked by it)."""
_JSON_KEYS |= set(_BATCH_KEYS)


def _batch_fields(row: dict, where: str) -> dict:
    """The batch fields of a JSON job as ``JobSpec`` takes them (a range as a tuple, rule keys as ints)."""
    out = {k: row[k] for k in _BATCH_KEYS if row.get(k) is not None}
    if isinstance(out.get("batch_size_range"), list):
        out["batch_size_range"] = tuple(out["batch_size_range"])
    rule = out.get("lr_rule")
    if isinstance(rule, dict):
        try:
            out["lr_rule"] = {int(b): v for b, v in rule.items()}
        except ValueError:
            raise ValueError(f"{where}: lr_rule keys {sorted(rule)[:5]} must be batch sizes (integers)") from None
    return out


def read_json_trace(path: str | os.PathLike, table: ThroughputTable) -> list[JobSpec]:
    """Parse virtualflow's JSON trace (see the module docstring) into ``JobSpec``s (ids 0..n-1 in
    order). Raises ``ValueError("FILE: job N: ...")`` for a malformed job (a field of the wrong type
    or out of the bounds of :mod:`virtualflow.cluster.bounds`) or a job type the throughput table
    does not know at the job's largest GPU count."""
    path = os.fspath(path)
    data = bounds.load_json(path, what="trace")
    rows = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected {{\"jobs\": [{{\"job_type\": ..., \"total_steps\": ..., "
                         f"\"scale_factor\": ...}}, ...]}} with at least one job")
    known = set(table.job_types)
    jobs: list[JobSpec] = []
    for i, row in enumerate(rows):
        where = f"{path}: job {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: must be an object, got {type(row).__name__}")
        extra = sorted(set(row) - _JSON_KEYS)
        missing = sorted({"job_type", "total_steps", "scale_factor"} - set(row))
        if extra or missing:
            raise ValueError(f"{where}: unknown keys {extra} / missing keys {missing}; a job has "
                             f"{sorted(_JSON_KEYS)} (job_type, total_steps and scale_factor required)")
        job_type = bounds.text(row["job_type"], where=where, field="job_type")
        if job_type not in known:
            raise ValueError(f"{where}: unknown job type {job_type!r}; the throughput table knows "
                             f"{sorted(known)[:5]}{' ...' if len(known) > 5 else ''}")
        total_steps = bounds.number(row["total_steps"], where=where, field="total_steps", lo=0, lo_open=True,
                                    hi=bounds.MAX_STEPS, meaning="a job's steps")
        scale = bounds.number(row["scale_factor"], where=where, field="scale_factor", lo=1,
                              hi=bounds.MAX_GPUS_PER_JOB, integral=True, meaning="GPUs of a job")
        min_gpus = row.get("min_gpus")
        if min_gpus is not None:
            min_gpus = bounds.number(min_gpus, where=where, field="min_gpus", lo=1, hi=scale, integral=True,
                                     meaning="an elastic job's fewest GPUs, at most its scale_factor")
        weight = bounds.number(row.get("weight", 1.0), where=where, field="weight", lo=0, lo_open=True,
                               hi=bounds.MAX_WEIGHT, meaning="a job's priority")
        arrival = bounds.number(row.get("arrival_s", 0.0), where=where, field="arrival_s", lo=0,
                                hi=bounds.MAX_SIM_S, meaning="seconds into the trace, ten years at most")
        slo = row.get("slo_s")
        if slo is not None:
            slo = bounds.number(slo, where=where, field="slo_s", lo=0, lo_open=True, hi=bounds.MAX_SIM_S,
                                meaning="seconds after arrival, ten years at most")
        try:
            job = JobSpec(job_id=i, job_type=job_type, scale_factor=scale, min_gpus=min_gpus,
                          total_steps=total_steps, weight=weight, arrival_s=arrival, slo_s=slo,
                          **_batch_fields(row, where))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not any(_has_throughput(table, job.job_type, t, job.scale_factor) for t in table.acc_types):
            raise ValueError(f"{where}: the throughput table has no throughput for {job.job_type!r} at "
                             f"scale_factor={job.scale_factor}")
        check_job(where, table, job_type, total_steps, scale)
        jobs.append(job)
    return jobs


def write_json_trace(path: str | os.PathLike, jobs: Sequence[JobSpec]) -> None:
    """Write jobs as virtualflow's JSON trace (round-trips through :func:`read_json_trace`)."""
    import json

    with open(path, "w") as f:
        json.dump({"jobs": [{"job_type": j.job_type, "total_steps": float(j.total_steps),
                             "scale_factor": int(j.scale_factor), "min_gpus": j.min_gpus, "weight": float(j.weight),
                             "arrival_s": float(j.arrival_s), "slo_s": j.slo_s,
                             **{k: getattr(j, k) for k in _BATCH_KEYS if getattr(j, k) is not None}}
                            for j in jobs]}, f, indent=1)
        f.write("\n")


@dataclass(kw_only=True, slots=True)
class GeneratorConfig:
    """Knobs of the synthetic workload (defaults: Gavel's continuous multi-GPU workload)."""

    num_jobs: int = 800
    """How many jobs to generate."""
    rate_per_hour: float = 2.0
    """Poisson arrival rate (jobs per hour); 0 puts every job at time 0."""
    seed: int = 0
    """Seed of the one ``numpy.random.Generator`` all draws come from."""
    reference_type: str = "v100"
    """Accelerator type whose throughput turns a duration into steps."""
    steps_reference: str = "one"
    """``"one"``: steps = duration x throughput on one reference GPU; ``"scale"``: on scale_factor GPUs."""
    multi_gpu: bool = True
    """False: every job asks for one GPU."""
    elastic_fraction: float = 0.0
    """Fraction of jobs that are elastic (``min_gpus=1``, ``scale_factor`` = the drawn maximum)."""
    priorities: tuple[float, ...] | None = None
    """If set, each job's weight is drawn uniformly from these values (else 1)."""
    scale_choices: tuple[int, ...] = SCALE_CHOICES
    """GPU counts to draw from."""
    scale_probs: tuple[float, ...] = SCALE_PROBS
    """Their probabilities."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_jobs <= MAX_JOBS:
            raise ValueError(f"num_jobs={self.num_jobs} must be in [1, {MAX_JOBS}] (jobs to generate)")
        if not (self.rate_per_hour <= MAX_RATE_PER_HOUR):
            raise ValueError(f"rate_per_hour={self.rate_per_hour} must be at most {MAX_RATE_PER_HOUR:g} jobs per hour")
        if not (self.rate_per_hour >= 0 and math.isfinite(self.rate_per_hour)):
            raise ValueError(f"rate_per_hour={self.rate_per_hour} must be a finite number >= 0")
        if self.steps_reference not in ("one", "scale"):
            raise ValueError(f"steps_reference={self.steps_reference!r} must be 'one' or 'scale'")
        if not 0.0 <= self.elastic_fraction <= 1.0:
            raise ValueError(f"elastic_fraction={self.elastic_fraction} must be in [0, 1]")
        if len(self.scale_choices) != len(self.scale_probs) or not self.scale_choices:
            raise ValueError(f"scale_choices={self.scale_choices} and scale_probs={self.scale_probs} "
                             "must be non-empty and of the same length")
        if abs(sum(self.scale_probs) - 1.0) > 1e-9 or min(self.scale_probs) < 0:
            raise ValueError(f"scale_probs={self.scale_probs} must be >= 0 and sum to 1")
        if self.priorities is not None and (not self.priorities or min(self.priorities) <= 0):
            raise ValueError(f"priorities={self.priorities} must be a non-empty tuple of positive weights")


def draw_duration_s(rng: np.random.Generator, n: int) -> np.ndarray:
    """Gavel's duration distribution, in seconds: 10**U(1.5,3) min w.p. 0.8, else 10**U(3,4) min."""
    long = rng.random(n) >= 0.8
    exps = np.where(long, rng.uniform(3.0, 4.0, n), rng.uniform(1.5, 3.0, n))
    return 60.0 * 10.0 ** exps


def generate_jobs(table: ThroughputTable, config: GeneratorConfig | GavelTraceConfig | None = None,
                  **kw) -> list[JobSpec]:
    """Draw ``config.num_jobs`` jobs (ids 0..n-1 in arrival order). Keyword arguments build a config.

    A :class:`~virtualflow.cluster.gavel_trace.GavelTraceConfig` (``parse_generate_spec("gavel:...")``)
    gives the job sequence Gavel's own scripts generate (:func:`generate_gavel_jobs`)."""
    if isinstance(config, GavelTraceConfig):
        return generate_gavel_jobs(table, config, **kw)
    cfg = config if config is not None else GeneratorConfig(**kw)
    if config is not None and kw:
        raise ValueError("pass either a GeneratorConfig or keyword arguments, not both")
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_jobs
    types = list(table.job_types)
    if not types:
        raise ValueError("the throughput table has no job types")
    # Which job types can run at each GPU count on the reference type.
    by_scale = {s: [t for t in types if _has_throughput(table, t, cfg.reference_type, s)] for s in cfg.scale_choices}
    for s, ts in by_scale.items():
        if not ts:
            raise ValueError(f"no job type has a throughput at {s} GPUs on reference_type={cfg.reference_type!r}; "
                             "change scale_choices or the table")
    # Draws in a fixed order (arrivals, durations, scales, type picks, elastic, priorities).
    if cfg.rate_per_hour > 0:
        gaps = rng.exponential(3600.0 / cfg.rate_per_hour, n)
        gaps[0] = 0.0
        arrivals = np.cumsum(gaps)
    else:
        arrivals = np.zeros(n)
    durations = draw_duration_s(rng, n)
    if cfg.multi_gpu:
        pick = rng.choice(len(cfg.scale_choices), size=n, p=np.asarray(cfg.scale_probs))
        scales = np.asarray(cfg.scale_choices)[pick]
    else:
        scales = np.ones(n, dtype=int)
    picks = rng.random(n)
    elastic = rng.random(n) < cfg.elastic_fraction
    weights = (np.asarray(cfg.priorities, dtype=float)[rng.integers(0, len(cfg.priorities), n)]
               if cfg.priorities else np.ones(n))
    jobs: list[JobSpec] = []
    for i in range(n):
        s = int(scales[i])
        candidates = by_scale.get(s) or [t for t in types if _has_throughput(table, t, cfg.reference_type, s)]
        if not candidates:
            raise ValueError(f"no job type runs on {s} GPUs of {cfg.reference_type!r}")
        jt = candidates[min(int(picks[i] * len(candidates)), len(candidates) - 1)]
        ref_scale = 1 if cfg.steps_reference == "one" else s
        steps = float(durations[i]) * table.throughput(jt, cfg.reference_type, ref_scale)
        jobs.append(JobSpec(job_id=i, job_type=jt, scale_factor=s, min_gpus=1 if elastic[i] else None,
                            total_steps=steps, weight=float(weights[i]), arrival_s=float(arrivals[i])))
    return jobs


_GEN_KEYS = {"rate": "rate_per_hour", "rate_per_hour": "rate_per_hour", "jobs": "num_jobs",
             "num_jobs": "num_jobs", "seed": "seed", "elastic": "elastic_fraction",
             "elastic_fraction": "elastic_fraction", "steps_reference": "steps_reference",
             "reference": "reference_type", "reference_type": "reference_type", "priorities": "priorities",
             "multi_gpu": "multi_gpu"}


_GAVEL_KEYS = {"rate": "rate_per_hour", "rate_per_hour": "rate_per_hour", "jobs": "num_jobs",
               "num_jobs": "num_jobs", "seed": "seed", "static": "static", "multi_gpu": "multi_gpu",
               "multi_priority": "multi_priority", "slos": "slos", "reference": "reference_type",
               "reference_type": "reference_type", "duration": "fixed_duration_s",
               "fixed_duration_s": "fixed_duration_s"}


def _flag(val: str) -> bool:
    v = val.strip().lower()
    if v in ("1", "true", "yes"):
        return True
    if v in ("0", "false", "no"):
        return False
    raise ValueError(val)


def _parse_gavel_spec(spec: str) -> GavelTraceConfig:
    kw: dict = {}
    static = False
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, eq, val = part.partition("=")
        key, val = key.strip(), val.strip()
        if not eq or key not in _GAVEL_KEYS:
            raise ValueError(f"--generate gavel: {part!r} is not KEY=VALUE with KEY in {sorted(_GAVEL_KEYS)} "
                             "(e.g. gavel:rate=2.0,jobs=800,seed=0, or gavel:static=1,jobs=100,seed=0)")
        name = _GAVEL_KEYS[key]
        try:
            if name in ("num_jobs", "seed"):
                kw[name] = int(val)
            elif name in ("rate_per_hour", "fixed_duration_s"):
                kw[name] = float(val)
            elif name == "static":
                static = _flag(val)
            elif name in ("multi_gpu", "multi_priority", "slos"):
                kw[name] = _flag(val)
            else:
                kw[name] = val
        except ValueError:
            raise ValueError(f"--generate gavel: {key}={val!r} is not a valid value") from None
    if static:
        if kw.get("rate_per_hour", 0.0) != 0.0:
            raise ValueError(f"--generate gavel: static=1 puts every job at time 0 but rate={kw['rate_per_hour']} "
                             "was given; drop one of them")
        kw["rate_per_hour"] = 0.0
    return GavelTraceConfig(**kw)


def parse_generate_spec(spec: str) -> GeneratorConfig | GavelTraceConfig:
    """``"rate=2.0,jobs=800,seed=0"`` -> GeneratorConfig (also ``elastic=0.5``,
    ``priorities=1/5/10``, ``steps_reference=scale``, ``reference=v100``, ``multi_gpu=0``).

    ``"gavel:rate=2.0,jobs=800,seed=0"`` -> GavelTraceConfig: the jobs Gavel's own scripts generate
    (also ``static=1`` for Gavel's static sweep, every job at 0; ``multi_gpu=0``,
    ``multi_priority=1``, ``slos=1``, ``duration=SECONDS``, ``reference=v100``)."""
    head, colon, rest = spec.partition(":")
    if colon and head.strip().lower() == "gavel":
        return _parse_gavel_spec(rest)
    kw: dict = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or key not in _GEN_KEYS:
            raise ValueError(f"--generate: {part!r} is not KEY=VALUE with KEY in "
                             f"{sorted(set(_GEN_KEYS))} (e.g. rate=2.0,jobs=800,seed=0)")
        name = _GEN_KEYS[key]
        val = val.strip()
        try:
            if name in ("num_jobs", "seed"):
                kw[name] = int(val)
            elif name in ("rate_per_hour", "elastic_fraction"):
                kw[name] = float(val)
            elif name == "priorities":
                kw[name] = tuple(float(v) for v in val.split("/"))
            elif name == "multi_gpu":
                kw[name] = val.lower() not in ("0", "false", "no")
            else:
                kw[name] = val
        except ValueError:
            raise ValueError(f"--generate: {key}={val!r} is not a valid value") from None
    return GeneratorConfig(**kw)
