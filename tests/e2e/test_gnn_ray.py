"""The Dorylus engine's tensor workers as Ray tasks (one short run on a local Ray instance): a
Ray worker SIGKILLed while holding a tensor task is sent again and the run equals
single-process PyTorch Geometric."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.nn import GCNConv

from virtualflow.gnn import GNNJob, GNNModel, karate_club, train_dorylus, train_pyg


def gcn():
    return GNNModel([GCNConv(34, 8), GCNConv(8, 4)])


@pytest.fixture
def ray_local():
    import ray  # a test dependency (the test extra)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_tensor_workers_killed_task_resent_same_result(ray_local):
    job = GNNJob(graph=karate_club(train_per_class=2), model=gcn, epochs=2, seed=5)
    ref = train_pyg(job)
    res = train_dorylus(job, graph_servers=1, intervals=2, tensor_workers=2, worker_backend="ray", kill_tasks=(2,),
                        timeout_s=180)
    assert res.relaunches == 1 and res.tw_tasks == 2 * 2 * 5 + 1
    for k in ref.state_dict:
        torch.testing.assert_close(res.state_dict[k], ref.state_dict[k], atol=2e-5, rtol=1e-4, msg=k)
