"""``reduction="fsdp"`` refused at launch, before any worker starts, in one line naming the value,
the rule and the knob: units that do not exist (or nest), a weight shared by two units, more
workers (or ``max_workers``) than a unit has elements, an optimizer whose update is not
elementwise, ``offload="cpu"`` beyond the host's available memory, and the layouts the
composition table refuses (pipeline stages, tensor parallelism, Bamboo, ``shard_replicas=1``).

In process: the launch's checks (:class:`virtualflow.launching.fsdp.FsdpLaunch`,
:func:`virtualflow.plan.memory.check_host_memory`) are called directly on built models; the tests
through ``vf.train`` run with the local backend's worker start replaced by a failure, so a check
that came after a worker started would fail them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import virtualflow as vf
from virtualflow.backends.local import LocalBackend
from virtualflow.config.composition import refusal
from virtualflow.launching.fsdp import FsdpLaunch, available_host_bytes, host_bytes_per_worker
from virtualflow.plan.memory import check_host_memory
import jobs
import pipeline_models


@pytest.fixture(autouse=True)
def no_workers(monkeypatch):
    """Any test here that reaches a worker start fails: the refusals come first."""

    def refuse(self, worker_id):
        raise AssertionError("a worker was started before reduction='fsdp' was checked")

    monkeypatch.setattr(LocalBackend, "start_worker", refuse)


class Blocks(nn.Module):
    """An embedding, a ``ModuleList`` of two blocks (the default units) and a head (the root unit)."""

    def __init__(self, width: int = 4, tie_blocks: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])
        if tie_blocks:
            self.blocks[1].weight = self.blocks[0].weight
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _built(model: nn.Module, optimizer=torch.optim.AdamW):
    params = [p for p in model.parameters() if p.requires_grad]
    return model, optimizer(params, lr=0.1), params


def test_the_default_units_are_the_blocks_and_a_root_and_pass():
    model, opt, params = _built(Blocks())
    units = FsdpLaunch(shard_units=None, workers=4).check(model, opt, params)
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "<root>"]
    assert [u.numel for u in units] == [20, 20, 16 + 5]


def test_units_that_do_not_exist_are_refused_naming_them_and_the_knob():
    model, opt, params = _built(Blocks())
    with pytest.raises(ValueError, match=r"^shard_units=\['blocks\.0', 'nope'\]: \['nope'\] are neither module names "
                                         r"nor class names of Blocks .*fix shard_units= \(--shard-units\)$"):
        FsdpLaunch(shard_units=("blocks.0", "nope"), workers=2).check(model, opt, params)
    with pytest.raises(ValueError, match=r"unit 'blocks\.0' lies inside unit 'blocks'.*\(--shard-units\)$"):
        FsdpLaunch(shard_units=("blocks", "blocks.0"), workers=2).check(model, opt, params)
    plain = nn.Linear(3, 1)  # no ModuleList/Sequential: the default has nothing to shard
    with pytest.raises(ValueError, match=r"Linear has none; name the unit modules .*--shard-units"):
        FsdpLaunch(shard_units=None, workers=2).check(*_built(plain))


def test_a_weight_shared_by_two_units_is_refused():
    model, opt, params = _built(Blocks(tie_blocks=True))
    with pytest.raises(ValueError, match=r"^reduction='fsdp': parameter blocks\.1\.weight is shared by units "
                                         r"'blocks\.0' and 'blocks\.1'.*\(shard_units=, --shard-units\)"):
        FsdpLaunch(shard_units=None, workers=2).check(model, opt, params)
    # one unit holding both users is fine
    FsdpLaunch(shard_units=("blocks",), workers=2).check(model, opt, params)


def test_more_workers_than_a_unit_has_elements_is_refused():
    model, opt, params = _built(Blocks(width=1))  # blocks of 2 elements each
    FsdpLaunch(shard_units=None, workers=2).check(model, opt, params)
    with pytest.raises(ValueError, match=r"^reduction='fsdp' with 3 workers: unit 'blocks\.0' has 2 elements, fewer "
                                         r"than workers.*use at most 2 workers \(--workers\)"):
        FsdpLaunch(shard_units=None, workers=3).check(model, opt, params)


def test_more_workers_than_a_unit_has_elements_is_refused_for_max_workers_too():
    model, opt, params = _built(Blocks(width=1))
    with pytest.raises(ValueError, match=r"^the autoscaler may grow the job to max_workers=4 \(--max-workers\): "
                                         r"reduction='fsdp' with 4 workers: unit 'blocks\.0' has 2 elements"):
        FsdpLaunch(shard_units=None, workers=2, max_workers=4).check(model, opt, params)
    job = jobs.regression_job(virtual_nodes=8).replace(model=lambda: nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)))
    with pytest.raises(ValueError, match=r"^the autoscaler may grow the job to max_workers=4 \(--max-workers\)"):
        vf.train(job, workers=2, steps=1, reduction="fsdp", autoscale="efficiency", max_workers=4)


def test_an_optimizer_that_is_not_elementwise_is_refused_naming_fsdp():
    model, opt, params = _built(Blocks(), optimizer=torch.optim.Adagrad)
    with pytest.raises(ValueError, match=r"^reduction='fsdp' updates each worker's slice of the parameters "
                                         r"separately.*built torch\.optim\.adagrad\.Adagrad"):
        FsdpLaunch(shard_units=None, workers=2).check(model, opt, params)


def test_the_host_memory_rule_compares_the_workers_shards_with_what_is_available():
    check_host_memory(100.0, 4, 400.0)  # exactly enough
    check_host_memory(100.0, 4, None)  # unknown: nothing refused
    with pytest.raises(ValueError, match=r"^offload='cpu' keeps each worker's parameter shards, gradients and "
                                         r"optimizer state in host memory: 4 worker\(s\) on this host .* drop offload "
                                         r"\(--offload\)$"):
        check_host_memory(100.0, 4, 399.0)


def test_the_host_bytes_are_each_workers_shards_of_params_grads_and_optimizer_state():
    model, opt, params = _built(Blocks())  # units 20, 20, root 21 elements; AdamW: 2 slots; float32
    units = FsdpLaunch(shard_units=None, workers=2).check(model, opt, params)
    # 1/W of each unit, rounded up: 10 + 10 + 11 elements, each with a weight, a gradient, 2 moments
    assert host_bytes_per_worker(units, opt, 2) == (10 + 10 + 11) * 4 * (1 + 1 + 2)
    sgd = torch.optim.SGD(params, lr=0.1)  # no momentum: no state
    assert host_bytes_per_worker(units, sgd, 3) == (7 + 7 + 7) * 4 * 2


def test_offload_beyond_the_hosts_available_memory_is_refused():
    model, opt, params = _built(Blocks())
    need = 4 * host_bytes_per_worker(FsdpLaunch(None, 4).check(model, opt, params), opt, 4)
    FsdpLaunch(None, 4, offload="cpu", local=True, available_bytes=need).check(model, opt, params)
    with pytest.raises(ValueError, match=r"^offload='cpu' .*: 4 worker\(s\) on this host"):
        FsdpLaunch(None, 4, offload="cpu", local=True, available_bytes=need - 1).check(model, opt, params)
    # workers on other hosts (Ray, external): this host's memory is not theirs
    FsdpLaunch(None, 4, offload="cpu", local=False, available_bytes=need - 1).check(model, opt, params)
    assert available_host_bytes() is None or available_host_bytes() > 0
    assert available_host_bytes("/nonexistent/meminfo") is None


@pytest.mark.parametrize("pipeline, row", [
    (dict(stages=2), "fsdp+pipeline"),
    (dict(stages=1, tensor=2), "fsdp+tensor"),
    (dict(stages=2, redundancy=True), "fsdp+bamboo"),
], ids=["pipeline", "tensor", "bamboo"])
def test_launch_refuses_sharded_parameters_with_a_pipeline_layout(pipeline, row):
    job = pipeline_models.mlp_job(vf.Pipeline(**pipeline), virtual_nodes=4)
    with pytest.raises(ValueError) as info:
        vf.train(job, workers=4, steps=1, reduction="fsdp")
    assert str(info.value) == refusal(row).says(reduction="fsdp", **pipeline)
    assert "\n" not in str(info.value)


def test_shard_replicas_with_fsdp_is_refused_with_the_tables_message():
    with pytest.raises(ValueError) as info:
        vf.train(jobs.regression_job(), workers=2, steps=1, reduction="fsdp", shard_replicas=1)
    assert str(info.value) == refusal("fsdp+shard_replicas").message()


def test_a_bad_unit_is_refused_by_train_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"^shard_units=\['body'\]: \['body'\] are neither module names nor class "
                                         r"names of Sequential"):
        vf.train(jobs.regression_job(), workers=2, steps=1, reduction="fsdp", shard_units=["body"])
    with pytest.raises(ValueError, match=r"^reduction='fsdp' updates each worker's slice"):
        vf.train(jobs.regression_job().replace(optimizer=lambda p: torch.optim.Adagrad(p)), workers=2, steps=1,
                 reduction="fsdp")


def test_offload_is_checked_against_this_hosts_memory_by_train(monkeypatch):
    from virtualflow.launching import fsdp

    monkeypatch.setattr(fsdp, "available_host_bytes", lambda path="/proc/meminfo": 1000)  # a tiny host
    with pytest.raises(ValueError, match=r"^offload='cpu' keeps each worker's parameter shards.*: 2 worker\(s\) on "
                                         r"this host x"):
        vf.train(jobs.regression_job(), workers=2, steps=1, reduction="fsdp", offload="cpu")
