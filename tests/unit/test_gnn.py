"""Dorylus GNN engine (issue 19): equivalence with single-process PyTorch Geometric, bounded
staleness, weight stashing, and the pure parts (partition, rules, prices). In-process
(simulated mode) except the one multi-process run in test_gnn_process.py."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.nn import GATConv, GCNConv

from virtualflow.gnn import (DorylusOptions, GNNJob, GNNModel, ParameterServer, PriceModel, WorkerLimits,
                             karate_club, make_graph, sbm_graph, train_dorylus, train_pyg, value)
from virtualflow.gnn.job import prepare
from virtualflow.gnn.partition import balanced_cuts, partition
from virtualflow.gnn.staleness import fresh_enough, may_start


def gcn_karate():
    return GNNModel([GCNConv(34, 8), GCNConv(8, 4)])


def gat_karate():
    return GNNModel([GATConv(34, 4, heads=2), GATConv(8, 4, heads=2, concat=False)], activation="elu")


def gcn3_karate():
    return GNNModel([GCNConv(34, 8), GCNConv(8, 8, improved=True), GCNConv(8, 4)])


def assert_same(result, ref, atol=2e-5):
    assert result.state_dict.keys() == ref.state_dict.keys()
    for k in ref.state_dict:
        torch.testing.assert_close(result.state_dict[k], ref.state_dict[k], atol=atol, rtol=1e-4, msg=k)
    for h, r in zip(result.history, ref.history, strict=True):
        assert h["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-6)
        assert h["train_acc"] == pytest.approx(r["train_acc"])


@pytest.fixture(scope="module")
def karate():
    return karate_club(train_per_class=2)


@pytest.mark.parametrize("servers,intervals", [(1, 1), (1, 3), (2, 2), (3, 1), (3, 3)])
def test_sync_equals_pyg_gcn(karate, servers, intervals):
    job = GNNJob(graph=karate, model=gcn_karate, epochs=8, seed=3)
    ref = train_pyg(job)
    res = train_dorylus(job, graph_servers=servers, intervals=intervals, tensor_workers=2, mode="simulated")
    assert res.num_intervals == servers * intervals and res.updates == job.epochs
    assert_same(res, ref)
    assert res.accuracy == pytest.approx(ref.accuracy)


@pytest.mark.parametrize("model", [gat_karate, gcn3_karate])
def test_sync_equals_pyg_gat_and_deeper(karate, model):
    job = GNNJob(graph=karate, model=model, epochs=6, seed=1)
    ref = train_pyg(job)
    assert_same(train_dorylus(job, graph_servers=2, intervals=2, tensor_workers=3, mode="simulated"), ref)


@pytest.mark.parametrize("kw", [dict(tensor_workers=0), dict(pipeline=False), dict(order="natural")])
def test_sync_equals_pyg_cpu_only_lockstep_natural_order(karate, kw):
    job = GNNJob(graph=karate, model=gcn_karate, epochs=5, seed=2)
    assert_same(train_dorylus(job, graph_servers=2, intervals=2, mode="simulated", **kw), train_pyg(job))


def slow_interval_0(kind, interval):
    return 3.0 if interval == 0 else 1.0  # a straggler: interval 0's tasks take 3x


@pytest.fixture(scope="module")
def sbm_job():
    g = sbm_graph(num_nodes=1200, classes=4, features=16, avg_degree_in=6, avg_degree_out=3, feature_noise=3.0,
                  train_per_class=20, seed=0)
    return GNNJob(graph=g, model=lambda: GNNModel([GCNConv(16, 16), GCNConv(16, 4)]), epochs=60, seed=0)


@pytest.fixture(scope="module")
def sbm_sync(sbm_job):
    return train_dorylus(sbm_job, graph_servers=2, intervals=3, tensor_workers=2, mode="simulated")


def test_sync_equals_pyg_on_generated_graph(sbm_job, sbm_sync):
    assert_same(sbm_sync, train_pyg(sbm_job), atol=1e-4)
    # with a straggler and other counts too (the schedule changes, the result does not)
    job = GNNJob(graph=sbm_job.graph, model=sbm_job.model, epochs=5, seed=0)
    res = train_dorylus(job, graph_servers=3, intervals=2, tensor_workers=4, mode="simulated",
                        sim_duration=slow_interval_0)
    assert_same(res, train_pyg(job), atol=1e-4)


@pytest.mark.parametrize("staleness", [1, 2])
def test_bounded_staleness_respects_bound_and_accuracy(sbm_job, sbm_sync, staleness):
    sync = sbm_sync
    res = train_dorylus(sbm_job, graph_servers=2, intervals=3, tensor_workers=2, staleness=staleness,
                        mode="simulated", sim_duration=slow_interval_0)
    log = res.staleness
    # The bound: no interval started an epoch more than S ahead of the slowest; no value older than S.
    assert log.max_lead <= staleness and log.max_read_age <= staleness
    # And it was used: the fast intervals ran ahead of the straggler and read stale values.
    assert log.max_lead == staleness and log.stale_reads > 0
    assert res.updates == sbm_job.epochs  # "round": one step per gradient from every interval
    assert abs(res.accuracy["test_acc"] - sync.accuracy["test_acc"]) <= 0.01, (res.accuracy, sync.accuracy)
    assert sync.accuracy["test_acc"] > 0.6  # the task is learnable (4 classes: chance is 0.25)


def test_per_interval_updates_respect_bound(sbm_job):
    job = GNNJob(graph=sbm_job.graph, model=sbm_job.model, epochs=5, seed=0)
    res = train_dorylus(job, graph_servers=2, intervals=2, tensor_workers=2, staleness=1, update="interval",
                        mode="simulated", sim_duration=slow_interval_0)
    assert res.updates == job.epochs * res.num_intervals  # Dorylus's per-interval updates
    assert res.staleness.max_lead == 1 and res.staleness.max_read_age <= 1


def test_weight_stashing_backward_uses_forward_version(sbm_job):
    job = GNNJob(graph=sbm_job.graph, model=sbm_job.model, epochs=6, seed=0)
    res = train_dorylus(job, graph_servers=2, intervals=3, tensor_workers=2, staleness=2, mode="simulated",
                        sim_duration=slow_interval_0, trace=True, update="interval")
    by_task: dict = {}
    for r in res.trace:
        by_task.setdefault((r["interval"], r["epoch"]), []).append(r)
    moved_on = 0
    for (i, e), recs in by_task.items():
        assert len({r["version"] for r in recs}) == 1, (i, e, recs)  # one version for the whole epoch
        fwd = {r["layer"]: r["checksum"] for r in recs if r["op"] in ("forward", "last")}
        for r in recs:
            if r["op"] == "backward":
                # the backward's weights are the forward's weights, not the latest ones
                assert r["checksum"] == fwd[r["layer"]], (i, e, r["layer"])
                moved_on += r["latest"] > r["version"]
    assert moved_on > 0  # newer versions existed while those backwards ran: the stash was needed


def test_parameter_server_keeps_pinned_versions():
    torch.manual_seed(0)
    model = GNNModel([GCNConv(4, 3)])
    ps = ParameterServer(model, lambda p: torch.optim.SGD(p, lr=0.5))
    v0 = ps.pin()
    w0 = ps.get(v0, ("convs.0.lin.weight",))["convs.0.lin.weight"].clone()
    ps.step({"convs.0.lin.weight": torch.ones(3, 4)})
    v1 = ps.pin()
    assert (v0, v1) == (0, 1)
    torch.testing.assert_close(ps.get(v0, ("convs.0.lin.weight",))["convs.0.lin.weight"], w0)
    torch.testing.assert_close(ps.get(v1, ("convs.0.lin.weight",))["convs.0.lin.weight"], w0 - 0.5)
    ps.release(v0)
    assert v0 not in ps.snapshots and v1 in ps.snapshots


# ---- pure parts ----------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["rcm", "natural"])
def test_partition_invariants(sbm_job, order):
    model = sbm_job.build_model()
    pg = prepare(sbm_job, model)
    plan = partition(pg.looped, pg.num_nodes, 3, 4, order)
    owned = torch.cat([iv.own for iv in plan.intervals])
    assert sorted(owned.tolist()) == list(range(pg.num_nodes))  # the intervals partition the vertices
    eids = torch.cat([iv.edge_ids for iv in plan.intervals])
    assert sorted(eids.tolist()) == list(range(pg.looped.size(1)))  # every edge exactly once
    for iv in plan.intervals:
        src = iv.sources[iv.edge_index[0]]
        dst = iv.own[iv.edge_index[1]]
        torch.testing.assert_close(torch.stack([src, dst]), pg.looped[:, iv.edge_ids])
        assert torch.equal(iv.sources[: iv.n_own], iv.own)
        for k in iv.in_neighbours:
            assert iv.index in plan.intervals[k].readers
    for p in range(3):
        ghosts = set(plan.ghosts(p).tolist())
        mine = set(torch.cat([plan.intervals[k].own for k in plan.server_intervals[p]]).tolist())
        assert not ghosts & mine and ghosts | mine == set(plan.server_vertices[p].tolist())
    if order == "rcm":  # the neighbour-preserving order cuts fewer edges than the ids' order
        assert plan.edge_cut() < partition(pg.looped, pg.num_nodes, 3, 4, "natural").edge_cut()


def test_balanced_cuts():
    assert balanced_cuts(torch.ones(10), 2) == [0, 5, 10]
    assert balanced_cuts(torch.tensor([100.0, 1, 1, 1]), 4) == [0, 1, 2, 3, 4]  # never an empty range
    cuts = balanced_cuts(torch.tensor([1.0, 1, 1, 1, 4]), 2)
    assert cuts[0] == 0 and cuts[-1] == 5 and 0 < cuts[1] < 5


def test_staleness_rules():
    assert may_start(0, [0, 0], 0) and not may_start(1, [1, 0], 0)
    assert may_start(1, [1, 0], 1) and not may_start(2, [2, 0], 1)
    assert fresh_enough(3, 3, 0) and not fresh_enough(2, 3, 0)
    assert fresh_enough(2, 3, 1) and not fresh_enough(-1, 0, 5)  # a value must exist


def test_price_model():
    pm = PriceModel(server_usd_per_hour=3.6, usd_per_gb_s=0.5, worker_gb=2.0, usd_per_request=0.01)
    c = pm.cost(servers=2, wall_s=100.0, worker_busy_s=10.0, requests=5)
    assert c["server_usd"] == pytest.approx(0.2) and c["worker_usd"] == pytest.approx(10.05)
    assert value(2.0, 0.5) == pytest.approx(1.0)


# ---- bad input ------------------------------------------------------------------------------


def test_bad_input_errors(karate):
    with pytest.raises(ValueError, match="no vertex features"):
        make_graph(None, karate.edge_index, karate.y, karate.train_mask)
    with pytest.raises(ValueError, match="train_mask has 10 entries but the graph has 34 vertices"):
        make_graph(karate.x, karate.edge_index, karate.y, torch.ones(10, dtype=torch.bool))
    with pytest.raises(ValueError, match="test_mask has 40 entries"):
        make_graph(karate.x, karate.edge_index, karate.y, karate.train_mask, test_mask=torch.ones(40, dtype=torch.bool))
    job = GNNJob(graph=karate, model=gcn_karate, epochs=1)
    with pytest.raises(ValueError, match=r"staleness=-1 must be an int >= 0.*--staleness"):
        DorylusOptions(staleness=-1)
    with pytest.raises(ValueError, match=r"graph_servers=35 is more than the graph's 34 vertices.*--graph-servers"):
        train_dorylus(job, graph_servers=35, mode="simulated")
    with pytest.raises(ValueError, match=r"--intervals"):
        train_dorylus(job, graph_servers=10, intervals=4, mode="simulated")
    with pytest.raises(ValueError, match="dropout=0.5 must be 0"):
        GNNModel([GATConv(34, 4, dropout=0.5)])
    with pytest.raises(ValueError, match="in_channels=5 but the graph has 34 features"):
        GNNJob(graph=karate, model=lambda: GNNModel([GCNConv(5, 4)]), epochs=1).build_model()
    with pytest.raises(ValueError, match="epochs=0"):
        GNNJob(graph=karate, model=gcn_karate, epochs=0)
    with pytest.raises(ValueError, match="timeout_prob"):
        WorkerLimits(timeout_prob=1.5)


# ---- command line ---------------------------------------------------------------------------

JOB_FILE = '''
from torch_geometric.nn import GCNConv
from virtualflow.gnn import GNNJob, GNNModel, karate_club

def make_job():
    return GNNJob(graph=karate_club(train_per_class=2), model=lambda: GNNModel([GCNConv(34, 8), GCNConv(8, 4)]),
                  epochs=4, seed=0)

def not_a_job():
    return 3
'''


def test_cli_gnn_runs_baselines_and_reports(tmp_path, capsys):
    import json

    from virtualflow.cli.main import main

    path = tmp_path / "job.py"
    path.write_text(JOB_FILE)
    rc = main(["gnn", str(path), "-P", "2", "-L", "2", "-K", "2", "--mode", "simulated", "--baselines", "cpu,pyg",
               "--json", "--target", "0.1"])
    out = capsys.readouterr().out
    assert rc == 0
    records = json.loads(out)  # stdout is the JSON document alone
    assert [r["run"] for r in records] == ["dorylus S=0", "cpu-only", "pyg"]
    # S=0 and the CPU-only baseline train the same model as PyG: same accuracy
    assert records[0]["test_acc"] == records[1]["test_acc"] == records[2]["test_acc"]
    assert records[1]["servers"] == 4 and records[1]["tensor_workers"] == 0
    assert records[1]["value_vs_cpu-only"] == 1.0 and records[0]["cost_usd"] > 0
    assert records[0]["tw_tasks"] == 4 * 4 * 5  # epochs x intervals x tensor tasks per interval-epoch


def test_cli_gnn_bad_input_is_one_line_exit_2(tmp_path, capsys):
    from virtualflow.cli.main import main

    path = tmp_path / "job.py"
    path.write_text(JOB_FILE)
    assert main(["gnn", str(path), "--staleness", "-2", "--mode", "simulated"]) == 2
    assert "staleness=-2 must be an int >= 0" in capsys.readouterr().err
    assert main(["gnn", f"{path}:not_a_job", "--mode", "simulated"]) == 2
    assert "not virtualflow.gnn.GNNJob" in capsys.readouterr().err
    assert main(["gnn", str(path), "-P", "40", "--mode", "simulated"]) == 2
    assert "graph_servers=40 is more than the graph's 34 vertices" in capsys.readouterr().err


def test_example_jobs_train(tmp_path):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "gnn_sbm.py")
    spec = importlib.util.spec_from_file_location("gnn_sbm_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for job in (mod.make_job(num_nodes=400, epochs=2), mod.make_gat_job(num_nodes=300, epochs=2)):
        assert_same(train_dorylus(job, graph_servers=2, intervals=2, mode="simulated"), train_pyg(job), atol=1e-4)


def test_emulated_limits_on_the_virtual_clock(karate):
    """One server, one worker, one interval, every task 1 s: an epoch is 12 steps (5 on the tensor
    worker), each tensor task adds the latency, the worker's first task the cold start, and a
    bandwidth limit the tensors' transfer time."""
    job = GNNJob(graph=karate, model=gcn_karate, epochs=2, seed=0)
    base = dict(graph_servers=1, intervals=1, tensor_workers=1, mode="simulated")
    plain = train_dorylus(job, **base)
    assert plain.wall_s == pytest.approx(2 * 12.0)
    slow = train_dorylus(job, limits=WorkerLimits(latency_s=0.5, cold_start_s=3.0), **base)
    assert slow.wall_s == pytest.approx(2 * 12.0 + 2 * 5 * 0.5 + 3.0)
    assert slow.tw_busy_s == pytest.approx(2 * 5 * 1.5 + 3.0) and slow.tw_tasks == 10
    bw = 1e6
    narrow = train_dorylus(job, limits=WorkerLimits(bandwidth_bytes_per_s=bw), **base)
    moved = narrow.bytes_to_tw + narrow.bytes_from_tw
    assert moved > 0 and narrow.wall_s == pytest.approx(2 * 12.0 + moved / bw)
    # an emulated timeout is a pure function of (seed, task, attempt): the relaunched attempt differs
    lim = WorkerLimits(timeout_prob=0.5, seed=3)
    draws = [lim.hangs(t, 0) for t in range(200)]
    assert draws == [lim.hangs(t, 0) for t in range(200)] and 50 < sum(draws) < 150
