"""Multi-job cluster scheduling (Gavel-style): cluster/job model, throughput tables, policies.

The round-based mechanism, simulator and traces live in sibling modules of this package; Gavel's
measured throughputs and example traces ship with it as package data (``gavel_data_dir()``).
"""

from __future__ import annotations

from virtualflow.cluster.gavel_data import gavel_data_dir, gavel_trace_names, gavel_trace_path
from virtualflow.cluster.model import Cluster, JobSpec
from virtualflow.cluster.policies.base import (
    Allocation,
    AllocationError,
    Policy,
    PolicyInput,
    check_allocation,
    get_policy,
    policy_names,
)
from virtualflow.cluster.throughputs import ThroughputTable

__all__ = ["Allocation", "AllocationError", "Cluster", "JobSpec", "Policy", "PolicyInput", "ThroughputTable",
           "check_allocation", "gavel_data_dir", "gavel_trace_names", "gavel_trace_path", "get_policy",
           "policy_names"]
