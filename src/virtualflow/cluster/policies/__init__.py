"""Scheduling policies (one module per family) and their registry; see ``base`` for the contract."""

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
