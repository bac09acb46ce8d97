"""The VN engine in-process (one worker, no process group): memory and reduction details."""

from __future__ import annotations

import pytest
import torch

from virtualflow.comm.groups import Group
from virtualflow.comm.reduce import tree_reduce_local
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment, covering_nodes
from virtualflow.runtime.engine import BatchLoader, VNEngine
import jobs


class LiveSaved:
    """Counts bytes of tensors autograd holds for backward, and the peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor):
        outer = self

        class Holder:
            def __init__(self) -> None:
                self.t = t
                self.n = t.numel() * t.element_size()
                outer.live += self.n
                outer.peak = max(outer.peak, outer.live)

            def __del__(self) -> None:
                outer.live -= self.n

        return Holder()

    @staticmethod
    def unpack(h):
        return h.t


def engine_for(job, deterministic=False):
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    ds = job.build_dataset()
    plan = DataPlan.of_job(job, len(ds))
    eng = VNEngine(model, opt, None, job.loss, plan, BatchLoader(ds, None), seed=job.seed,
                   batchnorm=job.batchnorm, deterministic=deterministic, device=torch.device("cpu"))
    eng.set_membership(Group(0, 0, 1, None), contiguous_assignment(job.virtual_nodes, 1))
    return eng


def peak_saved_bytes(job, deterministic=False) -> int:
    eng = engine_for(job, deterministic)
    counter = LiveSaved()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        for s in range(2):
            eng.step(s)
    assert counter.live == 0  # everything saved for backward was freed
    return counter.peak


@pytest.mark.parametrize("deterministic", [False, True])
def test_only_one_virtual_nodes_activations_are_alive(deterministic):
    wide = jobs.bn_job().replace(global_batch_size=64, virtual_nodes=8)  # 8 VNs of 8 samples
    one = jobs.bn_job().replace(global_batch_size=8, virtual_nodes=1)    # 1 VN of 8 samples
    whole = jobs.bn_job().replace(global_batch_size=64, virtual_nodes=1)  # 1 VN of 64 samples
    p_wide, p_one, p_whole = (peak_saved_bytes(j, deterministic) for j in (wide, one, whole))
    assert p_wide == p_one  # running 8 VNs holds exactly one VN's activations at a time
    assert p_whole > 4 * p_wide  # and the measure is sensitive: 8x the samples, far more bytes


def test_tree_reduce_local_matches_sum_and_order():
    calls = []

    def leaf(v):
        calls.append(v)
        return torch.full((3,), float(v))

    out = tree_reduce_local(covering_nodes(8, 0, 8), leaf)
    assert calls == list(range(8))  # VNs run in order, one at a time
    assert torch.equal(out[(0, 8)], torch.full((3,), 28.0))


def test_non_finite_step_is_not_applied():
    eng = engine_for(jobs.nan_job())
    for s in range(jobs.NAN_STEP):
        assert eng.step(s).bad_vns == []
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    opt_before = {k: v.clone() for k, v in eng.optimizer.state_dict()["state"][0].items()}
    out = eng.step(jobs.NAN_STEP)
    assert out.bad_vns == [jobs.NAN_VN]
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(eng.optimizer.state_dict()["state"][0]["momentum_buffer"], opt_before["momentum_buffer"])
