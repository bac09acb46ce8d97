"""Single-process full-graph PyTorch Geometric training: the reference the engine must equal
(``staleness=0``) and the baseline the benchmark and ``virtualflow gnn --baselines`` run."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from virtualflow.gnn.engine import GNNResult, evaluate
from virtualflow.gnn.job import GNNJob, prepare
from virtualflow.gnn.staleness import StalenessLog


def train_pyg(job: GNNJob, threads: int | None = None) -> GNNResult:
    """The PyG way: ``model(x, edge_index)``, cross-entropy on the training vertices, one step per epoch."""
    if threads is not None:
        torch.set_num_threads(threads)
    model = job.build_model()
    pg = prepare(job, model)
    opt = job.optimizer(model.parameters())
    train = pg.masks["train_mask"]
    history = []
    t0 = time.perf_counter()
    for epoch in range(job.epochs):
        model.train()
        opt.zero_grad(set_to_none=True)
        out = model(pg.x, pg.edge_index)
        loss = F.cross_entropy(out[train], pg.y[train])
        loss.backward()
        opt.step()
        pred = out.detach().argmax(-1)
        rec = {"epoch": epoch, "time_s": time.perf_counter() - t0, "loss": float(loss.detach()), "version": epoch + 1}
        for m, v in pg.masks.items():
            rec[m.replace("_mask", "_acc")] = float((pred[v] == pg.y[v]).float().mean()) if int(v.sum()) else None
        history.append(rec)
    wall = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        acc = evaluate(model, pg)
    return GNNResult(state_dict={k: v.detach().clone() for k, v in model.state_dict().items()}, history=history,
                     accuracy=acc, wall_s=wall, startup_s=0.0, servers=1, tensor_workers=0, tw_busy_s=0.0, tw_tasks=0,
                     relaunches=0, timeouts=0, bytes_to_tw=0, bytes_from_tw=0, staleness=StalenessLog(),
                     updates=job.epochs, edge_cut=0, num_intervals=1)
