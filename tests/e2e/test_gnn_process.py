"""The Dorylus engine on real processes (one short run): 2 graph-server processes and 2
tensor-worker processes, a tensor worker SIGKILLed while holding a task and emulated timeouts
(relaunched, task sent again), and still exactly single-process PyTorch Geometric."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.nn import GCNConv

from virtualflow.gnn import GNNJob, GNNModel, WorkerLimits, karate_club, train_dorylus, train_pyg


def gcn():
    return GNNModel([GCNConv(34, 8), GCNConv(8, 4)])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_processes_killed_worker_relaunched_same_result():
    job = GNNJob(graph=karate_club(train_per_class=2), model=gcn, epochs=4, seed=5)
    ref = train_pyg(job)
    limits = WorkerLimits(timeout_prob=0.03, task_timeout_s=2.0, seed=1, latency_s=0.001)
    res = train_dorylus(job, graph_servers=2, intervals=2, tensor_workers=2, mode="process", kill_tasks=(5,),
                        limits=limits, timeout_s=120)
    assert res.relaunches == 1 + res.timeouts  # the killed task's worker, and one per timed-out attempt
    assert res.timeouts >= 1  # seed 1 draws at least one hang
    assert res.tw_tasks == 4 * 4 * 5 + res.relaunches  # 4 epochs x 4 intervals x 5 tensor tasks, + the retries
    for k in ref.state_dict:
        torch.testing.assert_close(res.state_dict[k], ref.state_dict[k], atol=2e-5, rtol=1e-4, msg=k)
    assert [h["loss"] for h in res.history] == pytest.approx([h["loss"] for h in ref.history], rel=1e-5)
