"""Elastic batch-size allocation (``cluster.policies.elastic_batch``): the DP against a brute-force
search, the opt-in invariant, bad input at submit, and the simulator applying batch changes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from virtualflow.cluster import Cluster, ThroughputTable, get_policy
from virtualflow.cluster.mechanism import MechanismConfig
from virtualflow.cluster.model import JobSpec
from virtualflow.cluster.policies.base import Allocation, PolicyInput, check_allocation
from virtualflow.cluster.policies.elastic_batch import BATCH_KEY, batch_rate, job_rates
from virtualflow.cluster.simulator import SimConfig, simulate

SCALES = (1, 2, 4, 8)


def random_table(rng: np.random.Generator, models: int = 3) -> ThroughputTable:
    """Random steps/s (sublinear in GPUs, falling with batch) for models at batches 32..256, Gavel-named."""
    thr = {}
    for m in range(models):
        base = rng.uniform(5, 20)
        for b in (32, 64, 128, 256):
            thr[f"m{m} (batch size {b})"] = {"v100": {g: float(base * 32 / b * g ** rng.uniform(0.4, 0.95))
                                                      for g in SCALES}}
    return ThroughputTable.from_dict({"throughputs": thr})


def random_jobs(rng: np.random.Generator, n: int) -> list[JobSpec]:
    """Jobs of 16-sample virtual nodes, V0 in [lowest count, 2 x scale_factor] (runnable with at most
    two virtual nodes per GPU), named after their batch (so the table's other batches are siblings)."""
    jobs = []
    for i in range(n):
        sf = int(rng.choice([1, 2, 4, 8]))
        elastic = rng.random() < 0.7
        lo = 1 if elastic else sf
        b0 = 16 * int(rng.choice([v for v in (2, 4, 8, 16) if lo <= v <= 2 * sf]))
        opted = rng.random() < 0.6
        hi = max(2 * b0, 32 * sf)
        jobs.append(JobSpec(job_id=i, job_type=f"m{rng.integers(3)} (batch size {b0})", scale_factor=sf,
                            min_gpus=1 if elastic else None, total_steps=100.0, weight=float(rng.uniform(0.5, 2)),
                            arrival_s=float(rng.uniform(0, 10)), batch_size=b0, vn_size=16,
                            batch_size_range=(16, hi) if opted else None, lr_rule="linear" if opted else None))
    return jobs


def brute_force(inp: PolicyInput, fixed_batch: bool, max_vns: int | None) -> tuple[float, dict[int, int]]:
    """Every combination of GPU counts (0: waits), each job at its best batch there: the best total
    value with every admitted job running. Returns (value, job id -> GPUs)."""
    cap = int(inp.capacities[0])
    choices, norms, lows = [], [], []
    for j in inp.jobs:
        lo = j.min_gpus if j.elastic else j.scale_factor
        gs = [g for g in SCALES if lo <= g <= min(j.scale_factor, cap)]
        bs = (j.batch_size,) if fixed_batch or not j.elastic_batch else j.batch_sizes
        R = job_rates(inp.table, j, "v100", np.array(gs, dtype=np.int64), bs, max_vns)
        at_base = [R[r, bs.index(j.batch_size)] for r in range(len(gs)) if R[r, bs.index(j.batch_size)] > 0]
        norms.append(at_base[-1])
        opts = [(g, R[r].max()) for r, g in enumerate(gs) if R[r].max() > 0]
        lows.append(opts[0][0])
        choices.append([(0, 0.0)] + opts)
    must, free = set(), cap
    for i in sorted(range(inp.n), key=lambda i: (inp.jobs[i].arrival_s, inp.jobs[i].job_id)):
        if lows[i] <= free:
            must.add(i)
            free -= lows[i]
    best, best_g = -math.inf, {}
    for combo in itertools.product(*choices):
        if any(combo[i][0] == 0 for i in must) or sum(c[0] for c in combo) > cap:
            continue
        val = sum(inp.jobs[i].weight * c[1] / norms[i] for i, c in enumerate(combo))
        if val > best + 1e-12:
            best, best_g = val, {inp.jobs[i].job_id: c[0] for i, c in enumerate(combo)}
    return best, best_g


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fixed_batch,max_vns", [(False, None), (True, None), (False, 2)])
def test_dp_equals_brute_force(seed, fixed_batch, max_vns):
    rng = np.random.default_rng(seed)
    table = random_table(rng)
    jobs = random_jobs(rng, 6)
    inp = PolicyInput(jobs=jobs, cluster=Cluster(gpus={"v100": int(rng.integers(8, 13))}), table=table)
    alloc = get_policy("elastic_batch", fixed_batch=fixed_batch, max_vns_per_gpu=max_vns).allocate(inp)
    check_allocation(alloc, inp)
    best, best_g = brute_force(inp, fixed_batch, max_vns)
    assert alloc.objective == pytest.approx(best, rel=1e-9)
    running = {j.job_id: (alloc.gpus[j.job_id] if alloc.X[i].sum() > 0 else 0) for i, j in enumerate(jobs)}
    assert running == best_g
    for j in jobs:  # the chosen batch is a best one at the chosen count, and an allowed one
        g = running[j.job_id]
        if g:
            b = alloc.info[BATCH_KEY][j.job_id]
            bs = (j.batch_size,) if fixed_batch or not j.elastic_batch else j.batch_sizes
            assert b in bs
            rates = job_rates(table, j, "v100", np.array([g]), bs, max_vns)[0]
            assert batch_rate(table, j, "v100", g, b) == pytest.approx(rates.max(), rel=1e-9)


def test_rate_model_measured_and_fitted():
    """(g, batch_size) and Gavel-named siblings are measured; other batches follow a ceil(V/g) + c(g) fit."""
    table = ThroughputTable.from_dict({"throughputs": {
        "m (batch size 64)": {"v100": {1: 10.0, 2: 15.0}},
        "m (batch size 256)": {"v100": {2: 5.0}}}})
    job = JobSpec(job_id=0, job_type="m (batch size 64)", scale_factor=2, min_gpus=1, total_steps=1.0,
                  batch_size=64, vn_size=32, batch_size_range=(32, 256), lr_rule="linear")
    a = (1 / 10.0) / 2  # one VN's time: the 1-GPU step of V0 = 2 VNs
    comm = 1 / 15.0 - a * 1  # the rest of the 2-GPU step
    assert batch_rate(table, job, "v100", 2, 64) == 15.0
    assert batch_rate(table, job, "v100", 2, 128) == pytest.approx((128 / 64) / (a * 2 + comm))
    assert batch_rate(table, job, "v100", 2, 256) == pytest.approx(5.0 * 256 / 64)  # measured sibling
    assert batch_rate(table, job, "v100", 2, 32) == 0.0  # 1 virtual node cannot use 2 GPUs


def test_job_that_did_not_opt_in_never_changes_batch():
    rng = np.random.default_rng(3)
    table = random_table(rng)
    jobs = [j for j in random_jobs(rng, 12)]
    cluster = Cluster(gpus={"v100": 8}, gpus_per_server={"v100": 8})
    r = simulate(jobs, cluster, table, get_policy("elastic_batch"),
                 SimConfig(mechanism=MechanismConfig(reallocate_on_events=True), check_allocations=True))
    changed = {jid for _, jid, _, _ in r.batch_log}
    assert changed and changed <= {j.job_id for j in jobs if j.elastic_batch}
    assert all(r.batch_changes[i] == 0 for i, j in enumerate(jobs) if not j.elastic_batch)
    assert np.all(np.isfinite(r.finish_s))


class Scripted:
    """A policy returning prepared batch decisions, one per solve (the last one repeated)."""

    name = "scripted"

    def __init__(self, batches: list[dict[int, int]]) -> None:
        self.batches, self.calls = batches, 0

    def allocate(self, inp: PolicyInput) -> Allocation:
        b = self.batches[min(self.calls, len(self.batches) - 1)]
        self.calls += 1
        return Allocation(rows=[(j.job_id,) for j in inp.jobs], X=np.ones((inp.n, 1)),
                          gpus={j.job_id: 1 for j in inp.jobs}, info={BATCH_KEY: b})


def test_simulator_applies_batch_change_and_charges_it():
    table = ThroughputTable.from_dict({"throughputs": {"m (batch size 64)": {"v100": {1: 10.0}}}})
    opt = dict(job_type="m (batch size 64)", scale_factor=1, batch_size=64, vn_size=32)
    jobs = [JobSpec(job_id=0, total_steps=1000.0, batch_size_range=(32, 128), lr_rule="sqrt", **opt),
            JobSpec(job_id=1, total_steps=10.0, arrival_s=50.0, **opt)]
    mech = MechanismConfig(reallocate_on_events=True, resize_cost_s=2.0, start_cost_s=0.0)
    r = simulate(jobs, Cluster(gpus={"v100": 2}), table, Scripted([{0: 64}, {0: 128}]), SimConfig(mechanism=mech))
    # 0-50 s at batch 64 (10 steps/s); then batch 128 in place (2 s) at the same base rate on one GPU.
    assert r.batch_log == [(50.0, 0, 64, 128)]
    assert r.lost_s[0] == pytest.approx(2.0)
    assert r.finish_s[0] == pytest.approx(50.0 + 2.0 + (1000.0 - 500.0) / 10.0)
    assert jobs[0].lr_multiplier(128) == pytest.approx(math.sqrt(2))
    with pytest.raises(ValueError, match="policy gave job 1 batch 128, which is not one of its batch sizes"):
        simulate(jobs, Cluster(gpus={"v100": 2}), table, Scripted([{0: 64, 1: 128}]), SimConfig(mechanism=mech))


BASE = dict(job_id=7, job_type="m", scale_factor=2, total_steps=10.0, batch_size=64, vn_size=32,
            batch_size_range=(32, 128), lr_rule="linear")


@pytest.mark.parametrize("change,message", [
    ({"batch_size_range": (128, 32)}, r"job 7: batch_size_range=\(128, 32\) is empty \(B_min > B_max\)"),
    ({"batch_size_range": (48, 128)}, r"does not divide into virtual nodes of vn_size=32"),
    ({"vn_size": None}, r"batch_size_range=\(32, 128\) needs vn_size"),
    ({"batch_size": 256}, r"batch_size=256 must lie in batch_size_range=\(32, 128\)"),
    ({"lr_rule": None}, r"batch_size_range=\(32, 128\) has no lr_rule"),
    ({"lr_rule": "cubic"}, r"lr_rule='cubic' must be 'linear', 'sqrt'"),
    ({"lr_rule": {32: 0.5, 64: 1.0}}, r"lr_rule has no multiplier for batch sizes \[96, 128\]"),
    ({"batch_size_range": (32,)}, r"batch_size_range=\(32,\) must be a tuple \(B_min, B_max\)"),
    ({"scale_factor": 4}, r"batch_size=64 is 2 virtual nodes of vn_size=32, fewer than the 4 GPUs"),
    ({"batch_size_range": None}, r"lr_rule='linear' is set but batch_size_range is not"),
    ({"batch_size": 48}, r"batch_size=48 is not a whole number of virtual nodes of vn_size=32"),
])
def test_bad_batch_fields_rejected_at_submit(change, message):
    with pytest.raises(ValueError, match=message) as err:
        JobSpec(**{**BASE, **change})
    assert "\n" not in str(err.value)


def test_lr_rules():
    j = JobSpec(**{**BASE, "lr_rule": {32: 0.4, 64: 1.0, 96: 1.3, 128: 1.9}})
    assert j.batch_sizes == (32, 64, 96, 128) and j.lr_multiplier(96) == 1.3
    assert JobSpec(**BASE).lr_multiplier(32) == 0.5
    plain = JobSpec(job_id=1, job_type="m", scale_factor=1, total_steps=1.0, batch_size=64)
    assert plain.batch_sizes == (64,) and not plain.elastic_batch


def test_json_trace_round_trips_batch_fields(tmp_path):
    from virtualflow.cluster.traces import read_json_trace, write_json_trace

    table = ThroughputTable.from_dict({"throughputs": {"m": {"v100": {1: 10.0, 2: 15.0}}}})
    jobs = [JobSpec(**{**BASE, "job_id": 0, "lr_rule": {32: 0.5, 64: 1.0, 96: 1.4, 128: 2.0}}),
            JobSpec(**{**BASE, "job_id": 1}),
            JobSpec(job_id=2, job_type="m", scale_factor=1, total_steps=5.0)]
    path = tmp_path / "jobs.json"
    write_json_trace(path, jobs)
    assert read_json_trace(path, table) == jobs
    path.write_text('{"jobs": [{"job_type": "m", "total_steps": 1, "scale_factor": 1, "batch_size": 64, '
                    '"vn_size": 32, "batch_size_range": [32, 128], "lr_rule": {"x": 1}}]}')
    with pytest.raises(ValueError, match=r"job 0: lr_rule keys \['x'\] must be batch sizes"):
        read_json_trace(path, table)
