"""The cluster service on a Ray cluster (``cluster start --backend ray``): slots are Ray resources.

One local Ray cluster with the slot types as custom resources (one node: 2 CPUs, ``v100``: 1,
``k80``: 2). A cluster whose slots claim more than Ray has is refused at ``cluster start``, naming
the resource, the counts and the knob, with nothing written. Then one short job of two workers,
which only the K80s can hold, runs through the service: its two Ray actors take both units of
``k80`` (seen in Ray's own resource accounting while it runs, ``v100`` untouched), they get the
emulated K80 slowdown asked for, and the final weights and optimizer state are bit-identical
(deterministic mode) to a standalone local run of the same job.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from conftest import assert_state_equal, flat_optimizer_state
from vn_reference import deterministic_reference
import jobs
from virtualflow.cli import main as cli_main
from virtualflow.service.runner import Service, init_cluster, ray_slot_shortage
from virtualflow.service.state import ClusterDB

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(HERE, "service_jobs.py") + ":paced"
RESOURCES = {"v100": 1, "k80": 2}


@pytest.fixture(scope="module")
def ray_cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": RESOURCES,
                                                      "include_dashboard": False})
    try:
        ray.init(address=c.address, logging_level="WARNING")
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_slots_the_ray_cluster_lacks_are_refused(ray_cluster, tmp_path, capsys):
    d = str(tmp_path / "c")
    common = ["cluster", "start", "--dir", d, "--backend", "ray", "--address", ray_cluster.address]
    assert cli_main.main([*common, "--slots", "v100=1,k80=3", "--cpus-per-worker", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "slot type 'k80' claims 3 slots (--slots k80=3)" in err and "has k80=2" in err
    assert "lower --slots k80=2" in err and len(err.strip().splitlines()) == 1
    assert cli_main.main([*common, "--slots", "v100=1,k80=2"]) == 2  # 3 workers x 1 CPU on 2 CPUs
    err = capsys.readouterr().err
    assert "need 3 CPUs" in err and "CPU=2" in err and "--cpus-per-worker" in err
    assert not os.path.exists(os.path.join(d, "cluster.db"))  # nothing written
    # The rule, pure: a type the cluster does not have at all.
    assert "has no resource 'p100'" in ray_slot_shortage({"p100": 1}, {"CPU": 4.0, "k80": 2.0}, 1.0)


@pytest.mark.timeout(600)
def test_a_job_runs_on_its_types_ray_resource_and_matches_its_standalone_run(ray_cluster, tmp_path):
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 1, "k80": 2}, policy="fifo", round_s=2.0, slowdowns={"k80": 2.0},
                 backend="ray", address=ray_cluster.address, cpus_per_worker=0.5, emulate_slowdowns=True).close()
    assert cli_main.main(["submit", JOB, "--dir", d, "--steps", "20", "--workers", "2", "--deterministic"]) == 0
    services: list[Service] = []
    errors: list[BaseException] = []

    def run():
        try:
            services.append(Service(d, poll_s=0.05))  # its database connection belongs to this thread
            services[0].run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    db = ClusterDB(d)
    free_k80, free_v100, asked, ray_actors = [], [], [], []
    deadline = time.monotonic() + 240  # a liveness bound: under load (two busy processes beside it) 90 s were not enough
    try:
        while (row := db.job(1)).state != "done":  # read once: it may turn "done" between two reads
            assert not errors and row.state in ("queued", "running"), (errors, row.error)
            assert time.monotonic() < deadline, "the job did not finish in 240 s"
            run_ = services[0].running.get(1) if services else None
            if run_ is not None:
                backend = run_.handle.backend
                asked.append((dict(backend.options.resources), dict(backend.config.slowdowns)))
                ray_actors.append(sum(w.node_id is not None for w in backend.workers.values()))
                free = ray.available_resources()
                free_k80.append(free.get("k80", 0.0))
                free_v100.append(free.get("v100", 0.0))
            time.sleep(0.05)
    finally:
        db.set_meta("stop_requested", True)
        thread.join(60)
    assert not thread.is_alive() and not errors, errors
    row = db.job(1)
    assert row.acc_type is None and {a["acc_type"] for a in db.allocations()} == {"k80"}
    # What the service asked Ray for, and what Ray accounted: both K80 units taken, the V100 free.
    assert asked and all(a == ({"k80": 1.0}, {0: 2.0, 1: 2.0}) for a in asked)
    assert min(free_k80) == 0.0 and min(free_v100) == 1.0
    assert ray_actors and max(ray_actors) == 2  # two Ray actors, placed (Ray gave them a node)
    ref = deterministic_reference(jobs.paced_regression_job().replace(loss=jobs.mse), 20)  # JOB unpaced
    final = torch.load(os.path.join(row.run_dir, "final.pt"), weights_only=False)
    assert final["step"] == 20
    assert_state_equal(final["model"], ref.state_dict)
    assert_state_equal(flat_optimizer_state(final["optimizer"]), flat_optimizer_state(ref.optimizer_state_dict))



def test_ray_knobs_are_checked_before_anything_is_written(tmp_path):
    d = str(tmp_path / "c")
    with pytest.raises(ValueError, match="--backend ray needs --address"):
        init_cluster(d, slots={"k80": 1}, policy="fifo", round_s=1.0, backend="ray")
    with pytest.raises(ValueError, match="apply to --backend ray"):
        init_cluster(d, slots={"k80": 1}, policy="fifo", round_s=1.0, address="auto")
    with pytest.raises(ValueError, match="not a cluster backend"):
        init_cluster(d, slots={"k80": 1}, policy="fifo", round_s=1.0, backend="slurm")
    assert not os.path.exists(d)
