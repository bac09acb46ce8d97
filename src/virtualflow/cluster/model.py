"""The cluster and the jobs a scheduler plans for: pure descriptions, validated on construction.

Invariants:

- ``Cluster.gpus`` maps accelerator type -> GPU count; its insertion order is the column order of
  every allocation matrix ``X`` built for that cluster (``Cluster.types``).
- Every count is a positive integer, every price a non-negative finite number, and
  ``gpus_per_server`` / ``prices`` (when given) name exactly the types of ``gpus``.
- A ``JobSpec`` is rigid (runs on exactly ``scale_factor`` GPUs) unless ``min_gpus`` is set, in
  which case it is an elastic virtualflow job that may run at any GPU count in
  ``[min_gpus, scale_factor]`` that the throughput table has.
- A ``JobSpec`` keeps its one global batch ``batch_size`` unless ``batch_size_range`` is set: then
  it opts in to batch-size changes, to any multiple of ``vn_size`` in the range (a batch ``B`` runs
  as ``V = B / vn_size`` virtual nodes of ``vn_size`` samples), with its learning rate following
  ``lr_rule``. ``total_steps`` counts steps at ``batch_size``: a step at batch ``B`` is
  ``B / batch_size`` of them (progress is measured in samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_GPUS_PER_SERVER = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Accelerators of a shared cluster, by type."""

    gpus: dict[str, int]
    """accelerator type -> number of GPUs of that type (insertion order = column order of X)."""
    gpus_per_server: dict[str, int] = field(default_factory=dict)
    """type -> GPUs per server (consolidated placement of multi-GPU jobs); missing types get 4."""
    prices: dict[str, float] | None = None
    """$ per GPU-hour of each type (needed by the cost policies only)."""

    def __post_init__(self) -> None:
        if not self.gpus:
            raise ValueError("Cluster.gpus is empty; give at least one accelerator type, e.g. {'v100': 4}")
        for t, n in self.gpus.items():
            if not isinstance(t, str) or not t:
                raise ValueError(f"accelerator type {t!r} must be a non-empty string")
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"Cluster.gpus[{t!r}]={n!r} must be a positive integer GPU count")
        per = dict(self.gpus_per_server)
        for t in per:
            if t not in self.gpus:
                raise ValueError(f"Cluster.gpus_per_server names type {t!r} which is not in gpus={list(self.gpus)}")
        for t in self.gpus:
            per.setdefault(t, DEFAULT_GPUS_PER_SERVER)
            n = per[t]
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"Cluster.gpus_per_server[{t!r}]={n!r} must be a positive integer")
        # Column order follows gpus, whatever order gpus_per_server was given in.
        object.__setattr__(self, "gpus_per_server", {t: per[t] for t in self.gpus})
        if self.prices is not None:
            missing = [t for t in self.gpus if t not in self.prices]
            extra = [t for t in self.prices if t not in self.gpus]
            if missing or extra:
                raise ValueError(f"Cluster.prices must name exactly the types {list(self.gpus)}; "
                                 f"missing {missing}, unknown {extra}")
            for t, p in self.prices.items():
                if not isinstance(p, (int, float)) or isinstance(p, bool) or not math.isfinite(p) or p < 0:
                    raise ValueError(f"Cluster.prices[{t!r}]={p!r} must be a finite price >= 0 ($ per GPU-hour)")
            object.__setattr__(self, "prices", {t: float(self.prices[t]) for t in self.gpus})

    @property
    def types(self) -> tuple[str, ...]:
        """Accelerator types, in column order."""
        return tuple(self.gpus)

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus.values())

    @classmethod
    def uniform(cls, gpus: dict[str, int], gpus_per_server: int = DEFAULT_GPUS_PER_SERVER,
                prices: dict[str, float] | None = None) -> Cluster:
        """A cluster whose servers all hold ``gpus_per_server`` GPUs."""
        return cls(gpus=dict(gpus), gpus_per_server={t: gpus_per_server for t in gpus}, prices=prices)

    @classmethod
    def parse(cls, spec: str, gpus_per_server: int = DEFAULT_GPUS_PER_SERVER,
              prices: dict[str, float] | None = None) -> Cluster:
        """``"v100=12,p100=12,k80=12"`` -> a cluster with those GPU counts (the CLI's ``--cluster``)."""
        gpus: dict[str, int] = {}
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, count = part.partition("=")
            name = name.strip()
            if not sep or not name:
                raise ValueError(f"cluster spec item {part!r} in {spec!r} must look like TYPE=COUNT, e.g. v100=12")
            try:
                n = int(count)
            except ValueError:
                raise ValueError(f"cluster spec item {part!r}: count {count.strip()!r} is not an integer") from None
            if name in gpus:
                raise ValueError(f"cluster spec {spec!r} names type {name!r} twice")
            gpus[name] = n
        if not gpus:
            raise ValueError(f"cluster spec {spec!r} is empty; expected e.g. v100=12,p100=12,k80=12")
        return cls.uniform(gpus, gpus_per_server, prices)


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """One training job as the scheduler sees it."""

    job_id: int
    """Unique id (rows of an allocation are named by job ids)."""
    job_type: str
    """Key of the throughput table, e.g. ``"ResNet-50 (batch size 64)"``."""
    scale_factor: int
    """GPUs the job uses (rigid job); for an elastic job, the most it may use."""
    total_steps: float
    """Steps to run to completion."""
    min_gpus: int | None = None
    """Set => elastic virtualflow job: may run at any GPU count in [min_gpus, scale_factor] the table has."""
    weight: float = 1.0
    """Priority weight (fairness policies give a job a share proportional to it)."""
    slo_s: float | None = None
    """Deadline, seconds after arrival (SLO policies only)."""
    arrival_s: float = 0.0
    """Arrival time, seconds."""
    batch_size: int | None = None
    """Global batch the job was submitted with (samples per step; None: unknown, never changed)."""
    vn_size: int | None = None
    """Samples per virtual node: the job runs ``batch_size / vn_size`` virtual nodes, so on at most that
    many GPUs (None: no virtual-node constraint)."""
    batch_size_range: tuple[int, int] | None = None
    """Set => the job allows batch-size changes: any multiple of ``vn_size`` in ``[B_min, B_max]``.
    Only for jobs that reach the same accuracy at every batch in the range (see docs/cluster.md)."""
    lr_rule: str | dict[int, float] | None = None
    """Learning rate at batch ``B`` as a multiple of the rate at ``batch_size``: ``"linear"``
    (``B / batch_size``), ``"sqrt"`` (``sqrt(B / batch_size)``) or ``{B: multiplier}`` naming every
    allowed ``B``. Required with ``batch_size_range``."""

    def __post_init__(self) -> None:
        if isinstance(self.scale_factor, bool) or not isinstance(self.scale_factor, int) or self.scale_factor <= 0:
            raise ValueError(f"job {self.job_id}: scale_factor={self.scale_factor!r} must be a positive integer")
        if self.min_gpus is not None:
            if isinstance(self.min_gpus, bool) or not isinstance(self.min_gpus, int) or not (
                    1 <= self.min_gpus <= self.scale_factor):
                raise ValueError(f"job {self.job_id}: min_gpus={self.min_gpus!r} must be an integer in "
                                 f"[1, scale_factor={self.scale_factor}] (or None for a rigid job)")
        if not math.isfinite(self.total_steps) or self.total_steps <= 0:
            raise ValueError(f"job {self.job_id}: total_steps={self.total_steps!r} must be a positive number")
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise ValueError(f"job {self.job_id}: weight={self.weight!r} must be a positive number")
        if self.slo_s is not None and (not math.isfinite(self.slo_s) or self.slo_s <= 0):
            raise ValueError(f"job {self.job_id}: slo_s={self.slo_s!r} must be a positive number of seconds "
                             "after arrival (or None for no SLO)")
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"job {self.job_id}: arrival_s={self.arrival_s!r} must be a time >= 0")
        self._check_batch()

    def _check_batch(self) -> None:
        """Batch fields (one line per fault naming value, rule and knob), checked at submit."""
        jid = f"job {self.job_id}"
        for name in ("batch_size", "vn_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{jid}: {name}={v!r} must be a positive integer number of samples")
        b, vn, rng = self.batch_size, self.vn_size, self.batch_size_range
        need = self.min_gpus or self.scale_factor
        if b is not None and vn is not None:
            if b % vn:
                raise ValueError(f"{jid}: batch_size={b} is not a whole number of virtual nodes of vn_size={vn}; "
                                 f"give a multiple of vn_size")
            if b // vn < need:
                raise ValueError(f"{jid}: batch_size={b} is {b // vn} virtual nodes of vn_size={vn}, fewer than the "
                                 f"{need} GPUs the job needs at least (one virtual node per GPU); raise batch_size "
                                 f"or lower {'min_gpus' if self.min_gpus else 'scale_factor'}")
        if rng is None:
            if self.lr_rule is not None:
                raise ValueError(f"{jid}: lr_rule={self.lr_rule!r} is set but batch_size_range is not; a job "
                                 f"that keeps its batch has no learning-rate rule (set batch_size_range to opt in)")
            return
        if (not isinstance(rng, tuple) or len(rng) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in rng)):
            raise ValueError(f"{jid}: batch_size_range={rng!r} must be a tuple (B_min, B_max) of positive integers")
        lo, hi = rng
        if lo > hi:
            raise ValueError(f"{jid}: batch_size_range={rng} is empty (B_min > B_max); give B_min <= B_max")
        if vn is None:
            raise ValueError(f"{jid}: batch_size_range={rng} needs vn_size (samples per virtual node): a batch "
                             f"size changes by changing the number of virtual nodes")
        if lo % vn or hi % vn:
            raise ValueError(f"{jid}: batch_size_range={rng} does not divide into virtual nodes of vn_size={vn}; "
                             f"B_min and B_max must be multiples of vn_size")
        if b is None or not lo <= b <= hi:
            raise ValueError(f"{jid}: batch_size={b!r} must lie in batch_size_range={rng} (the batch the job "
                             f"starts at and the one its lr_rule is relative to)")
        rule = self.lr_rule
        if rule is None:
            raise ValueError(f"{jid}: batch_size_range={rng} has no lr_rule; give 'linear', 'sqrt' or "
                             f"{{batch: multiplier}} so the learning rate follows the batch size")
        if isinstance(rule, str):
            if rule not in ("linear", "sqrt"):
                raise ValueError(f"{jid}: lr_rule={rule!r} must be 'linear', 'sqrt' or {{batch: multiplier}}")
            return
        if not isinstance(rule, dict):
            raise ValueError(f"{jid}: lr_rule={rule!r} must be 'linear', 'sqrt' or {{batch: multiplier}}")
        missing = [x for x in self.batch_sizes if x not in rule]
        if missing:
            raise ValueError(f"{jid}: lr_rule has no multiplier for batch sizes {missing[:5]} of "
                             f"batch_size_range={rng}; a {{batch: multiplier}} rule must name every multiple "
                             f"of vn_size={vn} in the range")
        bad = {k: v for k, v in rule.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0}
        if bad:
            raise ValueError(f"{jid}: lr_rule multipliers {bad} must be positive finite numbers")

    @property
    def elastic(self) -> bool:
        """True for an elastic job (``min_gpus`` set)."""
        return self.min_gpus is not None

    @property
    def elastic_batch(self) -> bool:
        """True for a job that allows batch-size changes (``batch_size_range`` set)."""
        return self.batch_size_range is not None

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes the job may run at, ascending (its one batch if it did not opt in; () if unknown)."""
        if self.batch_size_range is None:
            return () if self.batch_size is None else (self.batch_size,)
        lo, hi = self.batch_size_range
        assert self.vn_size is not None
        return tuple(range(lo, hi + 1, self.vn_size))

    def lr_multiplier(self, batch: int) -> float:
        """Learning rate at ``batch`` relative to the rate at ``batch_size`` (``lr_rule``)."""
        if batch not in self.batch_sizes:
            raise ValueError(f"job {self.job_id}: batch {batch} is not one of its batch sizes "
                             f"{self.batch_sizes[:8]} (batch_size_range={self.batch_size_range})")
        rule, b0 = self.lr_rule, self.batch_size
        if rule is None or b0 is None or batch == b0:
            return 1.0
        if isinstance(rule, dict):
            return float(rule[batch])
        return batch / b0 if rule == "linear" else math.sqrt(batch / b0)
