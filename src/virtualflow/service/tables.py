"""The throughput table the cluster service's slowdowns come from (Gavel's measurements).

One reader, shared by the service's process layer (:mod:`virtualflow.service.runner`), its
dashboard and the CLI, so none of them imports another for it. Invariant: it reads the package
data folder :func:`virtualflow.cluster.gavel_data.gavel_data_dir` names and nothing else.
"""

from __future__ import annotations

import os

from virtualflow.cluster.throughputs import ThroughputTable

__all__ = ["gavel_table"]


def gavel_table() -> ThroughputTable:
    """Gavel's per-job-type throughputs (``simulation_throughputs.json``)."""
    from virtualflow.cluster.gavel_data import gavel_data_dir

    return ThroughputTable.from_file(os.path.join(gavel_data_dir(), "simulation_throughputs.json"))
