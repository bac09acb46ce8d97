"""The cluster service's placement (virtualflow.backends.placement), without processes or Ray.

The service chooses one placement from its configuration and asks it, never a backend's name:
which launch options put a job's workers on a slot type, whether workers get their type's
slowdown, and how the slots are checked. These tests pin what each placement answers and that
``cluster start``'s validation (order and wording) is what it was in the runner.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from virtualflow.backends.placement import (LocalPlacement, Placement, RayPlacement, placement_from_config,
                                            placement_of, ray_slot_shortage)

SERVICE = pathlib.Path(__file__).resolve().parents[2] / "src" / "virtualflow" / "service"


def test_local_placement_emulates_types_and_adds_no_launch_options():
    p: Placement = placement_of("local")
    assert isinstance(p, LocalPlacement) and p.name == "local" and p.emulates_slowdowns
    assert p.worker_options("v100") == {}
    p.check_slots({"v100": 1000})  # emulated slots: any number fits


@pytest.mark.parametrize("emulate", [False, True])
def test_ray_placement_asks_for_one_unit_of_the_type_per_worker(emulate):
    p = placement_of("ray", address="10.0.0.1:6379", cpus_per_worker=0.5, emulate_slowdowns=emulate)
    assert isinstance(p, RayPlacement) and p.name == "ray" and p.emulates_slowdowns == emulate
    assert p.worker_options("k80") == {"backend": "ray", "address": "10.0.0.1:6379", "cpus_per_worker": 0.5,
                                       "resources": {"k80": 1.0}}


def test_the_recorded_configuration_gives_the_same_placement():
    assert placement_from_config({}) == LocalPlacement()
    assert placement_from_config({"backend": "local", "address": None}) == LocalPlacement()
    assert placement_from_config({"backend": "ray", "address": "auto", "cpus_per_worker": 2,
                                  "emulate_slowdowns": True}) == RayPlacement("auto", 2.0, True)


@pytest.mark.parametrize("backend, kwargs, message", [
    ("slurm", {}, "--backend 'slurm' is not a cluster backend; choose local"),
    ("local", {"address": "auto"}, "--address and --emulate-slowdowns apply to --backend ray"),
    ("local", {"emulate_slowdowns": True}, "--address and --emulate-slowdowns apply to --backend ray"),
    ("local", {"cpus_per_worker": 0.0}, "--cpus-per-worker 0 must be a positive number of Ray CPUs"),
    ("ray", {"cpus_per_worker": float("nan")}, "--cpus-per-worker nan must be a positive number"),
    ("ray", {}, "--backend ray needs --address"),
])
def test_bad_knobs_are_refused_naming_the_flag(backend, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        placement_of(backend, **kwargs)


def test_ray_slot_shortage_names_the_type_and_the_fix():
    assert ray_slot_shortage({"v100": 2}, {"v100": 2.0, "CPU": 4.0}, 1.0) is None
    short = ray_slot_shortage({"v100": 2}, {"v100": 1.0, "CPU": 4.0}, 1.0)
    assert short is not None and "--slots v100=2" in short and "lower --slots v100=1" in short
    cpus = ray_slot_shortage({"v100": 2}, {"v100": 2.0, "CPU": 1.0}, 1.0)
    assert cpus is not None and "need 2 CPUs" in cpus


def test_the_service_never_branches_on_a_backend_name():
    """No module of the service compares anything with a backend's name: the placement answers."""
    for path in sorted(SERVICE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                names = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                tuples = [e.value for c in [node.left, *node.comparators] if isinstance(c, ast.Tuple)
                          for e in c.elts if isinstance(e, ast.Constant)]
                assert not {"ray", "local"} & set(names + tuples), f"{path.name}:{node.lineno} branches on a backend"
