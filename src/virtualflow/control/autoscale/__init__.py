"""Autoscaling policies: pure objects that turn a history of observations into a decision.

The autoscaling engine searches, by trial and error while the job trains, for the most
resource-efficient number of workers (Or, Zhang, Freedman, "Resource Elasticity in Distributed
Deep Learning", MLSys 2020). It is split in two, as every policy in virtualflow is:

* a **policy** (this module) sees the history of :class:`Observation` records (one per training
  step: worker count, throughput, step time, cost rate, elapsed time, steps remaining) and
  returns a decision: :class:`Resize`, :class:`Stay`, :class:`Replace` or :class:`Rebalance`.
  It starts nothing, holds no mutable state and reads no clock, so it is tested on synthetic
  sequences (``tests/unit/test_autoscale.py``);
* an **executor** (:mod:`virtualflow.control.autoscale_executor`) makes the observations from
  the workers' step reports, asks the policy, and applies its decisions through in-place resize.

Invariants every built-in policy keeps:

1. **Decisions are a function of the history.** Calling ``decide`` twice on the same history
   gives the same decision; no state is kept between calls.
2. **A size is judged once.** Each worker count is measured on the first ``min_steps``
   post-warm-up steps run at it (the first ``warmup_steps`` of every generation are skipped: the
   regroup, cold caches) and that median is frozen; later steps at the same size never revise it.
   A judgement therefore cannot flip, so the search cannot oscillate: it visits every size at
   most once and makes at most (number of sizes in ``[min, max]``) + 1 resizes.
3. **Medians, not means.** One noisy step (a page fault storm, another process's burst) moves a
   median of ``min_steps >= 3`` samples by at most one rank: a single outlier cannot decide.
4. **Bounds.** A decision never leaves ``[Limits.min_workers, Limits.max_workers]``.
5. **Whole replicas.** A pipelined job's sizes are multiples of its replica's stages x tensor
   workers (``Limits.unit``; the bounds rounded inwards): no decision leaves a partial replica.
   Its sizes are searched with the replica time model (:mod:`.pipeline`): a size predicted no
   faster than a smaller one is never tried.

Policies never touch B, V or anything the model sees: they only choose how many workers run.
"""

from __future__ import annotations

from virtualflow.control.autoscale.base import (
    Decision, Limits, Observation, Policy, Rebalance, Replace, Resize, SizeMeasurement, Stay, measure_sizes,
    predicted_efficiency, scaling_efficiency,
)
from virtualflow.control.autoscale.pipeline import pipeline_limits, pipeline_step_model, replica_step
from virtualflow.control.autoscale.policies import (
    POLICIES, DeadlineUtility, EfficiencyPolicy, FixedPolicy, LinearUtility, StragglerPolicy, UtilityPolicy,
    make_policy, parse_utility,
)

__all__ = [
    "Observation", "Limits", "Resize", "Stay", "Replace", "Rebalance", "Decision", "Policy",
    "SizeMeasurement", "measure_sizes", "EfficiencyPolicy", "UtilityPolicy", "StragglerPolicy",
    "FixedPolicy", "LinearUtility", "DeadlineUtility", "parse_utility", "POLICIES", "make_policy",
    "scaling_efficiency", "predicted_efficiency", "pipeline_limits", "pipeline_step_model", "replica_step",
]
