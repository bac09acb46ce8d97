"""Autoscaling on the Ray backend: the same executor and in-place resizes as the local backend,
with the workers as Ray actors on a two-node Ray cluster on this machine. The efficiency policy
grows the job to the analytic answer and the weights are bit-identical to a static run's; the
step breakdown reaches the records from the actors too.

The workload is examples/emulated_scaling.py (EMULATED compute: sleep-paced virtual nodes)."""

from __future__ import annotations

import os
import sys

import pytest

import virtualflow as vf
from conftest import assert_state_equal
from vn_reference import one_worker

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
sys.path.insert(0, EXAMPLES)
import emulated_scaling as emu  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_efficiency_autoscales_ray_actors_with_static_weights(run_dir):
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2)
    try:
        ray.init(address=c.address, logging_level="WARNING")
        c.wait_for_nodes()
        # 1 -> 2 -> 3 workers each scale linearly on the emulated workload (efficiency 1.0): the
        # policy grows to max_workers=3 and settles there.
        result = vf.train(emu.make_job(), workers=1, steps=60, backend="ray", address=c.address,
                          cpus_per_worker=0.5, autoscale="efficiency:min_steps=3,warmup_steps=1",
                          min_workers=1, max_workers=3, run_dir=run_dir, deterministic=True)
    finally:
        ray.shutdown()
        c.shutdown()
    a = result.autoscale
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [1, 2, 3]
    assert a["settled_at"] == 3 and a["resizes"] == 2
    assert sum(1 for h in result.history if h.get("breakdown")) >= len(result.history) - 3
    ref = one_worker(emu.reference_job(), result.steps)
    assert_state_equal(result.state_dict, ref.state_dict)
