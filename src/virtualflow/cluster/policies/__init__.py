"""Scheduling policies (one module per family) and their registry; ``base`` holds the contract.

=====================  ===============  ====================================================
registry name          module           what it optimises
=====================  ===============  ====================================================
``fifo``               ``greedy``       arrival order (``by_weight=True``: priority queue)
``qssf``               ``greedy``       shortest predicted GPU service time first (Helios)
``las``                ``fairness``     weighted max-min of normalised effective throughput
``las_agnostic``       ``fairness``     the same, blind to accelerator speed
``finish_time_fairness`` ``fairness``   min of the largest finish-time ratio (Themis)
``elastic_fair``       ``elastic``      weighted GPU shares for elastic jobs, then ``las``
``elastic_batch``      ``elastic_batch`` GPUs and batch size per job by a DP over scaling
                                        efficiency (``fixed_batch=True``: GPUs only, its baseline)
``makespan``           ``efficiency``   min time until the last job finishes
``max_throughput``     ``efficiency``   max total normalised throughput
``min_jct``            ``efficiency``   linear surrogate of min total JCT (SRPT-like)
``min_cost``           ``cost``         max normalised throughput per dollar
``min_cost_slo``       ``cost``         the same subject to SLOs (relaxed when infeasible)
``las_space_sharing``  ``space_sharing`` ``las`` with pairs of jobs sharing accelerators
=====================  ===============  ====================================================
"""

from __future__ import annotations

from virtualflow.cluster.policies.base import (
    Allocation,
    AllocationError,
    Policy,
    PolicyInput,
    check_allocation,
    get_policy,
    policy_names,
)

__all__ = ["Allocation", "AllocationError", "Policy", "PolicyInput", "check_allocation", "get_policy",
           "policy_names"]
