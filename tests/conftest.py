import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


def assert_state_close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


def assert_state_equal(a: dict, b: dict) -> None:
    """Bit-identical (torch.equal would call -0.0 == 0.0; compare the bytes)."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.reshape(-1).view(torch.uint8) if x.is_floating_point() else x,
                           y.reshape(-1).view(torch.uint8) if y.is_floating_point() else y), f"{k} differs"


def flat_optimizer_state(sd: dict) -> dict:
    out = {}
    for pid, st in sd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{pid}.{name}"] = v
    return out


def assert_same_training(result, ref, *, first_step: int | None = 0, scheduler: bool = True) -> None:
    """``result`` trained exactly as ``ref``: same steps, bit-identical weights and optimizer
    state, same LR-scheduler state, and every step recorded exactly once (none lost or doubled
    by resizes or failures) from ``first_step`` (None: from the first recorded one, for a run
    resumed from a checkpoint)."""
    assert result.steps == ref.steps
    assert_state_equal(result.state_dict, ref.state_dict)
    assert_state_equal(flat_optimizer_state(result.optimizer_state_dict), flat_optimizer_state(ref.optimizer_state_dict))
    if scheduler:
        assert result.lr_scheduler_state_dict == ref.lr_scheduler_state_dict
    start = result.history[0]["step"] if first_step is None else first_step
    assert [h["step"] for h in result.history] == list(range(start, result.steps))


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone: it no longer runs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_step(handle, step: int, timeout_s: float = 120.0) -> None:
    """Wait until a launched job has recorded ``step`` steps (fails if it ends first)."""
    deadline = time.monotonic() + timeout_s
    while handle.status()["step"] < step:
        if handle.done:
            handle.wait()
            raise AssertionError(f"the job ended before step {step}")
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s} s"
        time.sleep(0.01)


def wait_for_members(handle, members: int, *, formed: bool = False, generation: int = 0,
                     timeout_s: float = 180.0) -> None:
    """Wait until a launched job's generation (at least ``generation``) has ``members`` ranked
    workers, and, with ``formed``, has formed too (fails if the job ends first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = handle.status()
        if (st.get("generation", 0) >= generation and len([w for w in st["workers"] if w["rank"] is not None]) == members
                and (not formed or st["formed_generation"] == st["generation"])):
            return
        assert time.monotonic() < deadline and not handle.done, st
        time.sleep(0.05)


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


# --------------------------------------------------------------------------------------------
# The ``gpu`` marker: tests that need a CUDA device. Without one they are skipped from here, one
# place, so pytest's summary groups them into a single line ("SKIPPED [N] tests/conftest.py:...")
# instead of one line per test. scripts/gpu-check.sh runs them on a machine with a GPU.

_NO_CUDA = None


def _no_cuda_reason() -> str:
    global _NO_CUDA
    if _NO_CUDA is None:
        _NO_CUDA = "" if torch.cuda.is_available() else (
            f"gpu tests need CUDA: torch.cuda.is_available() is False (torch {torch.__version__}); "
            "run scripts/gpu-check.sh on a machine with a GPU")
    return _NO_CUDA


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and _no_cuda_reason():
        pytest.skip(_no_cuda_reason())


# --------------------------------------------------------------------------------------------
# Two pytest processes (scripts/test.sh: pytest-xdist, ``-n 2 --dist loadfile``). A test file is
# one unit of work: its tests never run side by side and its module-scoped fixtures (a Ray
# cluster, a reference run) are built once. Files that share something machine-wide form one
# unit, run one after the other in one process: the hosts tests (network namespaces, bridges,
# tc: never two at once) and the Ray tests (each starts a Ray cluster on this machine; Ray test
# files are named test_ray.py or *_ray.py). pytest_collection_modifyitems refuses a ray-marked
# test or a test of the hosts fixtures in any other file.

_HOSTS_FILES = ("test_hosts.py", "test_host_faults.py")


def _unit_of_work(path: str) -> str:
    name = os.path.basename(path)
    if name in _HOSTS_FILES:
        return "hosts"
    if name == "test_ray.py" or name.endswith("_ray.py"):
        return "ray"
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndGroups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of_work(nodeid.split("::", 1)[0])

    return FilesAndGroups(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        unit = _unit_of_work(item.nodeid.split("::", 1)[0])
        if item.get_closest_marker("ray") is not None and unit not in ("ray", "hosts"):
            raise pytest.UsageError(f"{item.nodeid} is marked ray: put it in a file named test_ray.py or *_ray.py "
                                    "(tests/conftest.py runs those files one after the other)")
        if {"hosts", "make_hosts"} & set(getattr(item, "fixturenames", ())) and unit != "hosts":
            raise pytest.UsageError(f"{item.nodeid} builds hosts: add its file to _HOSTS_FILES in tests/conftest.py "
                                    "(hosts tests run one after the other)")
