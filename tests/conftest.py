import os

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


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")
