"""The Ray backend, end to end on a two-node Ray cluster on this machine.

One cluster per module (starting Ray costs seconds): two nodes with 1 CPU each and a custom
resource ``vf_slot`` (2 per node); the second node also has one ``accel_x`` (an accelerator type
only it has). Workers ask for ``vf_slot=1`` so the custom resource passes through to Ray, and for
half a CPU where three must fit.

The standard of proof is the local backend's (tests/test_elastic.py): deterministic mode, and
weights plus optimizer state bit-identical to an undisturbed run of as many steps (the VN engine
in this process, :mod:`vn_reference`: deterministic mode's bits do not depend on the workers).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import ray
from ray.cluster_utils import Cluster

import virtualflow as vf
from conftest import assert_same_training, assert_state_equal, flat_optimizer_state, wait_for_step
from virtualflow.backends.ray import WorkersUnavailable, parse_resources
from virtualflow.control.coordinator import Coordinator
from virtualflow.runtime.checkpoint import load_state
from vn_reference import deterministic_reference
import jobs

pytestmark = [pytest.mark.ray, pytest.mark.slow]

FOREVER = 1_000_000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGITS = os.path.join(ROOT, "examples", "digits.py")
SLOT = {"vf_slot": 1}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 1, "resources": {"vf_slot": 2}, "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"vf_slot": 2, "accel_x": 1})
    try:
        ray.init(address=c.address, logging_level="WARNING")
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def launch():
    """``vf.launch`` whose jobs are killed at teardown if a failed test left them running (a
    job outliving the module would keep using Ray after the cluster is shut down)."""
    started: list[vf.JobHandle] = []

    def _launch(*args, **kwargs) -> vf.JobHandle:
        started.append(vf.launch(*args, **kwargs))
        return started[-1]

    yield _launch
    for handle in started:
        if not handle.done:
            handle.kill()


def wait_for_free_cpus(cpus: float, timeout_s: float = 30.0) -> None:
    """Actors of a previous test are killed asynchronously: start from a quiet cluster."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < cpus - 1e-9:
        assert time.monotonic() < deadline, f"the cluster still has only {ray.available_resources()} free"
        time.sleep(0.05)


def unpaced() -> vf.Job:
    return jobs.elastic_job().replace(loss=jobs.cross_entropy)


@pytest.fixture(scope="module")
def digits_local():
    """The digits job, 12 deterministic steps on 2 local worker processes."""
    return vf.train(DIGITS, workers=2, steps=12, deterministic=True)


def test_digits_trains_bit_identical_on_two_ray_nodes_and_locally(cluster, digits_local, run_dir, launch):
    wait_for_free_cpus(2)
    # One CPU per worker: the two actors must land on different nodes.
    handle = launch(DIGITS, workers=2, steps=12, deterministic=True, run_dir=run_dir, backend="ray",
                       address=cluster.address, cpus_per_worker=1, resources=SLOT)
    result = handle.wait(timeout_s=240)
    nodes = {w.node_id for w in handle.backend.workers.values()}
    assert len(nodes) == 2 and None not in nodes
    assert result.steps == 12 and result.metrics["accuracy"] == digits_local.metrics["accuracy"]
    assert_state_equal(result.state_dict, digits_local.state_dict)
    assert_state_equal(flat_optimizer_state(result.optimizer_state_dict),
                       flat_optimizer_state(digits_local.optimizer_state_dict))
    # The workers reached the store on the node's address, not loopback; logs where local ones go.
    assert handle.coordinator.host == ray.util.get_node_ip_address()
    assert all(os.path.isfile(os.path.join(run_dir, "logs", f"worker-{w}.log")) for w in range(2))


def test_cli_backend_ray_trains_the_same_weights(cluster, digits_local, tmp_path):
    wait_for_free_cpus(2)
    d = str(tmp_path / "cli")
    p = subprocess.run(
        [sys.executable, "-m", "virtualflow.cli.main", "run", DIGITS, "--backend", "ray", "--address", cluster.address,
         "--workers", "2", "--cpus-per-worker", "0.5", "--resources", '{"vf_slot": 1}', "--steps", "12",
         "--deterministic", "--run-dir", d, "--no-progress"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "on 2 workers (Ray actors, " in p.stderr
    assert_state_equal(load_state(os.path.join(d, "final.pt"))["model"], digits_local.state_dict)


def test_resize_2_3_2_on_ray_keeps_training_in_place(cluster, run_dir, launch):
    wait_for_free_cpus(2)
    handle = launch(jobs.elastic_job, workers=2, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       backend="ray", address=cluster.address, cpus_per_worker=0.5, resources=SLOT)
    # A size the cluster could never hold is refused at once, naming what is short; the job goes on.
    with pytest.raises(WorkersUnavailable, match="resource 'CPU' is short: 5 workers need 2.5 CPU"):
        handle.resize(5)
    wait_for_step(handle, 3)
    handle.resize(3, wait=True, timeout_s=120)
    members = [w for w in handle.status()["workers"] if w["rank"] is not None]
    assert len(members) == 3
    # Ray starts worker processes at niceness 15; ours, the first two and the one the resize
    # started, run at the normal 0 (at 15, two busy processes left an actor ~5 % of a core).
    assert {w["id"]: os.getpriority(os.PRIO_PROCESS, w["pid"]) for w in members} == {w["id"]: 0 for w in members}
    # The command line reaches the coordinator at the node's address (from status.json).
    wait_for_step(handle, handle.status()["step"] + 3)
    from virtualflow.cli.main import main

    assert main(["resize", run_dir, "--workers", "2"]) == 0
    deadline = time.monotonic() + 60
    while True:  # (not --wait: it can read a status.json written before the request was taken)
        st = handle.status()
        if st["generation"] == 2 and st["formed_generation"] == 2:
            break
        assert time.monotonic() < deadline and not handle.done, f"the shrink did not happen: {st}"
        time.sleep(0.02)
    assert len([w for w in handle.status()["workers"] if w["rank"] is not None]) == 2
    wait_for_step(handle, handle.status()["step"] + 3)
    result = handle.stop()
    assert result.generations == 3 and not result.failures
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [2, 3, 2]
    # The newcomer was an actor on the cluster; the worker that left gave its actor back.
    assert len(handle.backend.workers) == 3 and all(w.code == 0 for w in handle.backend.workers.values())
    assert_same_training(result, deterministic_reference(unpaced(), result.steps))


def test_actor_killed_mid_run_survivors_redo_the_step(cluster, run_dir, launch):
    wait_for_free_cpus(2)
    handle = launch(jobs.elastic_job, workers=3, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       backend="ray", address=cluster.address, cpus_per_worker=0.5, resources=SLOT)
    wait_for_step(handle, 5)
    ray.kill(handle.backend.workers[1].actor)
    deadline = time.monotonic() + 60
    while not handle.status()["failures"]:
        assert time.monotonic() < deadline and not handle.done, "the killed actor was not noticed"
        time.sleep(0.01)
    wait_for_step(handle, handle.status()["step"] + 5)  # the survivors go on
    result = handle.stop()
    assert [f["worker"] for f in result.failures] == [1]
    assert "SIGKILL" in result.failures[0]["cause"]
    assert result.generations == 2
    assert {h["workers"] for h in result.history[-5:]} == {2}
    assert_same_training(result, deterministic_reference(unpaced(), result.steps))


def test_sigterm_to_an_actor_is_a_preemption_notice(cluster, run_dir, launch):
    """SIGTERM to a training actor's process (a spot node's notice) releases it at a step
    boundary, as for a local worker: no failure, no step redone, the actor ends with code 0."""
    wait_for_free_cpus(2)
    handle = launch(jobs.elastic_job, workers=3, steps=FOREVER, deterministic=True, run_dir=run_dir,
                    backend="ray", address=cluster.address, cpus_per_worker=0.5, resources=SLOT)
    wait_for_step(handle, 3)
    victim = handle.backend.workers[1]
    os.kill(victim.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while len([w for w in handle.status()["workers"] if w["rank"] is not None]) != 2:
        assert time.monotonic() < deadline and not handle.done, handle.status()
        time.sleep(0.02)
    wait_for_step(handle, handle.status()["step"] + 3)
    result = handle.stop()
    assert result.failures == [] and victim.code == 0
    assert [h["step"] for h in result.history] == list(range(result.steps))
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [3, 2]
    assert_same_training(result, deterministic_reference(unpaced(), result.steps))


def test_hung_actor_is_fenced_through_ray_and_the_run_stays_identical(cluster, run_dir, launch):
    """A worker that stops (SIGSTOP) is found by its silent heartbeat; kill_worker (ray.kill)
    must then really end the stopped process, and the survivors redo the step."""
    wait_for_free_cpus(2)
    plan = vf.FaultPlan([vf.Fault(worker=2, step=5, phase="mid_backward", action="hang")])
    handle = launch(jobs.elastic_job, workers=3, steps=20, deterministic=True, fault_plan=plan, run_dir=run_dir,
                       backend="ray", address=cluster.address, cpus_per_worker=0.5, resources=SLOT)
    result = handle.wait(timeout_s=240)
    assert [f["worker"] for f in result.failures] == [2]
    assert "stopped responding" in result.failures[0]["cause"]
    assert_same_training(result, deterministic_reference(unpaced(), 20))
    pid = handle.backend.pid(2)  # this cluster's nodes are this machine: the process is visible here
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, f"the stopped worker's process {pid} is still there"
        time.sleep(0.05)


def test_worker_specs_place_each_worker_on_its_device_type(cluster, run_dir, launch):
    # A heterogeneous job on Ray: worker 1 asks for the accelerator type only the second node
    # has; VNs are then mapped by measured speed as for any unequal workers, and the weights
    # are those of any other mapping (deterministic mode).
    wait_for_free_cpus(2)
    specs = [vf.WorkerSpec(), vf.WorkerSpec(resources={"accel_x": 1})]
    handle = launch(unpaced(), workers=2, steps=8, deterministic=True, run_dir=run_dir, backend="ray",
                    address=cluster.address, cpus_per_worker=0.5, resources=SLOT, worker_specs=specs)
    result = handle.wait(timeout_s=240)
    accel_node = next(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("accel_x"))
    assert handle.backend.workers[1].node_id == accel_node
    ref = deterministic_reference(unpaced(), 8)
    assert_same_training(result, ref)
    # A device type nobody has is refused before anything starts, naming it; and per-worker
    # resources mean nothing to the local backend.
    with pytest.raises(WorkersUnavailable, match="worker 1 asks for .*'accel_nope' is short"):
        vf.launch(unpaced(), workers=2, steps=8, backend="ray", address=cluster.address, cpus_per_worker=0.5,
                  worker_specs=[vf.WorkerSpec(), vf.WorkerSpec(resources={"accel_nope": 1})])
    with pytest.raises(ValueError, match="only apply to backend='ray'"):
        vf.launch(unpaced(), workers=2, steps=8, worker_specs=[vf.WorkerSpec(resources={"accel_x": 1}), vf.WorkerSpec()])
    with pytest.raises(ValueError, match="must map resource names to numbers > 0"):
        vf.WorkerSpec(resources={"accel_x": 0})


def test_a_resource_nobody_has_fails_at_once_naming_it(cluster):
    t0 = time.monotonic()
    with pytest.raises(WorkersUnavailable, match="'nobody_has_this' is short"):
        vf.launch(jobs.elastic_job, workers=2, steps=5, backend="ray", address=cluster.address,
                  cpus_per_worker=0.5, resources={"nobody_has_this": 1})
    # More workers than the nodes hold: the short resource is named too.
    with pytest.raises(WorkersUnavailable, match=r"resource 'accel_x' is short: 2 workers need 2 accel_x"):
        vf.launch(jobs.elastic_job, workers=2, steps=5, backend="ray", address=cluster.address,
                  cpus_per_worker=0.5, resources={"accel_x": 1})
    assert time.monotonic() - t0 < 10


def test_a_busy_resource_gives_up_after_the_placement_timeout_naming_it(cluster, launch):
    """The cluster has the resource, but something else holds it: bounded wait, then a clear error."""
    wait_for_free_cpus(2)
    held = ray.util.placement_group([{"accel_x": 1}])  # reserves the only accel_x, no process
    ray.get(held.ready(), timeout=30)
    try:
        t0 = time.monotonic()
        handle = launch(jobs.elastic_job, workers=1, steps=5, backend="ray", address=cluster.address,
                           cpus_per_worker=0.5, resources={"accel_x": 1}, placement_timeout_s=3)
        with pytest.raises(vf.TrainingError, match=r"not placed by Ray within 3 s .*short of accel_x"):
            handle.wait(timeout_s=60)
        assert time.monotonic() - t0 < 30
    finally:
        ray.util.remove_placement_group(held)


def test_without_ray_the_error_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install virtualflow[ray]")):
        vf.train(jobs.elastic_job, workers=1, steps=1, backend="ray")
    from virtualflow.cli.main import main

    assert main(["run", os.path.join(ROOT, "tests", "jobs.py") + ":elastic_job", "--steps", "1", "--backend", "ray", "--no-progress"]) == 2
    assert "pip install virtualflow[ray]" in capsys.readouterr().err


def test_ray_options_are_refused_on_the_local_backend_and_checked():
    with pytest.raises(ValueError, match="only apply to backend='ray'"):
        vf.launch(jobs.elastic_job, workers=1, steps=1, cpus_per_worker=2)
    with pytest.raises(ValueError, match="backend='nope' is not available"):
        vf.launch(jobs.elastic_job, workers=1, steps=1, backend="nope")
    with pytest.raises(ValueError, match="cpus_per_worker"):
        vf.launch(jobs.elastic_job, workers=1, steps=1, backend="ray", cpus_per_worker=-1)
    assert parse_resources("accel_a100=1, fast_disk=0.5") == {"accel_a100": 1.0, "fast_disk": 0.5}
    assert parse_resources('{"accel_a100": 2}') == {"accel_a100": 2.0}
    with pytest.raises(ValueError, match="NAME=AMOUNT"):
        parse_resources("accel_a100")


def test_local_coordinator_store_listens_on_loopback_only():
    ip = ray.util.get_node_ip_address()
    if ip.startswith("127."):
        pytest.skip("this machine has no non-loopback address to probe")
    coord = Coordinator(total_steps=1, run_dir=None)
    try:
        assert coord.host == "127.0.0.1"
        with socket.create_connection(("127.0.0.1", coord.port), timeout=5):
            pass
        with pytest.raises(OSError):
            socket.create_connection((ip, coord.port), timeout=5).close()
    finally:
        coord.close()
    # On Ray the store listens on the node's address, and there only.
    ray_coord = Coordinator(total_steps=1, run_dir=None, host=ip)
    try:
        with socket.create_connection((ip, ray_coord.port), timeout=5):
            pass
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", ray_coord.port), timeout=5).close()
    finally:
        ray_coord.close()


def test_ray_shut_down_under_a_running_job_ends_it_without_starting_ray_again(cluster, run_dir, launch):
    # The driver leaves Ray while the job runs: its actors die with it. The job must end (not
    # wait for workers forever), and virtualflow must not start or join Ray again behind the
    # user's back (Ray's auto-init): a cluster cannot be shut down while a driver holds it.
    wait_for_free_cpus(1)
    handle = launch(unpaced(), workers=2, steps=FOREVER, run_dir=run_dir, backend="ray", address=cluster.address,
                    cpus_per_worker=0.5, resources=SLOT)
    wait_for_step(handle, 2)
    ray.shutdown()
    try:
        deadline = time.monotonic() + 60
        while not handle.done:
            assert time.monotonic() < deadline, f"the job outlived Ray by 60 s: {handle.status()}"
            time.sleep(0.05)
        assert not ray.is_initialized()
        st = handle.status()
        assert st["state"] == "failed", st
    finally:
        if not ray.is_initialized():
            ray.init(address=cluster.address, logging_level="WARNING")  # for the module's other tests

