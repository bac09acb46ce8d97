"""Deterministic pipelines overlap their per-stage exchange with the last micro-batches' backward
(runtime/pipeline/tree_fold.py, links.py ``StageExchanges.open``/``part``).

- Each VN's gradients are added into the fixed tree as soon as every backward of its micro-batch
  on the worker ran; a partial sum that is complete goes to the exchange at once
  (:class:`TreePart`), before the remaining micro-batches' backward, and the step's
  :class:`StageTree` only finishes it. Shown on VN maps whose replicas hold several partials
  (V = 5 on 2 replicas: replica 0 holds (0, 2) and (2, 3)): the in-process driver sees the
  request before the last backward; over the process driver (``drive`` on an in-process fabric,
  ``owners`` exchange) the partial's point-to-point messages leave before the last backward.
- A weight shared by two workers (a tied embedding and head): the holder sends each micro-batch's
  gradient of its copy as that micro-batch's backward ends, not all of them after the last one.
- The model is still bit-identical to the unpipelined deterministic run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pipeline_models as pm
from conftest import assert_state_equal
from fabric import Fabric, run_ranks
from virtualflow.comm import exchange as exchange_module
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline.geometry import Grid, layers_of, resolve_bounds
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.pipeline.links import Links, StageExchanges, drive
from virtualflow.runtime.pipeline.local import LocalDriver, build_engine
from virtualflow.runtime.pipeline.requests import Send, StageTree, TreeOpen, TreePart

P, D, V, STEPS = 2, 2, 5, 2

# (the backward hooks that log when a piece's backward starts: a piece whose inputs need no gradient)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def _model() -> nn.Sequential:
    """No dropout: the fabric test runs its workers as threads (one global random generator)."""
    return nn.Sequential(nn.Linear(pm.FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 12),
                         nn.ReLU(), nn.Linear(12, 1))


def _engines(job=None, replicas: int = D):
    job = job or pm.mlp_job(Pipeline(stages=P, schedule="1f1b"), virtual_nodes=V, model=_model)
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    ds = job.build_dataset()
    engines = [build_engine(job, job.pipeline, bounds, r % P, dataset=ds, deterministic=True,
                            device=torch.device("cpu")) for r in range(P * replicas)]
    return job, engines


def _log_backwards(engine, log: list) -> None:
    """Write the start of every backward of ``engine``'s pieces into ``log`` (a hook that runs
    when the gradient of a piece's output is there, before the piece's own backward)."""
    for module in engine.pieces.values():
        module.register_full_backward_pre_hook(lambda mod, grad_out: log.append(("bwd",)))


def _logged(steps: Any, log: list):
    """``engine.steps`` whose deterministic-exchange requests also go into ``log``."""

    def wrapped(first_step: int, n_steps: int, control: Any = 0):
        log.append(("begin", first_step))
        gen = steps(first_step, n_steps, control)
        answer = None
        try:
            while True:
                req = gen.send(answer)
                if isinstance(req, TreeOpen):
                    log.append(("open", first_step))
                elif isinstance(req, TreePart):
                    log.append(("part", first_step, req.node))
                elif isinstance(req, StageTree):
                    log.append(("tree", first_step))
                elif isinstance(req, Send) and req.key[0] == "T":
                    log.append(("tied", first_step, req.key))
                answer = yield req
        except StopIteration as stop:
            return stop.value

    return wrapped


def _state(engines) -> dict[str, torch.Tensor]:
    """The whole model's state from replica 0's workers."""
    out: dict[str, torch.Tensor] = {}
    for e in engines[:P]:
        out.update({k: v.detach().clone() for k, v in e.model.state_dict().items()})
    return out


def _last_backward(log: list, step: int, m: int) -> int:
    """Where the ``m``-th (the last) backward of ``step`` starts in ``log``."""
    start = log.index(("begin", step))
    return [i for i in range(start, len(log)) if log[i] == ("bwd",)][m - 1]


def _check_order(log: list, step: int, m: int, early: tuple, late: tuple) -> None:
    """In ``step``: open, then partial ``early`` before the last backward starts, ``late`` after it."""
    at = {entry: i for i, entry in enumerate(log) if entry[0] != "bwd"}
    last = _last_backward(log, step, m)
    assert at[("begin", step)] < at[("open", step)] < at[("part", step, early)] < last
    assert last < at[("part", step, late)] < at[("tree", step)]


def test_in_process_partials_go_before_the_last_backward_and_bits_hold():
    job, engines = _engines()
    logs = [[] for _ in engines]
    for e, log in zip(engines, logs):
        _log_backwards(e, log)
        e.steps = _logged(e.steps, log)
    driver = LocalDriver(engines)
    driver.set_layout(contiguous_assignment(V, D))  # replica 0: VNs 0-2, (0, 2) and (2, 3); replica 1: (3, 5)
    history = []
    for t in range(STEPS):
        history += driver.run(t, 1)
    for r in (0, 1):  # both stages of replica 0, every step
        for t in range(STEPS):
            _check_order(logs[r], t, 3, (0, 2), (2, 3))
    for r in (2, 3):  # replica 1's one partial is final with its last backward
        assert [x for x in logs[r] if x[0] == "part"] == [("part", t, (3, 5)) for t in range(STEPS)]
    ref_state, ref_losses = pm.unpipelined(job, STEPS, True)
    assert_state_equal(_state(engines), ref_state)
    assert [h.loss for h in history] == ref_losses


def test_process_driver_sends_a_partial_before_the_last_backward_and_bits_hold(monkeypatch):
    job, engines = _engines()
    assignment = contiguous_assignment(V, D)
    generation = Fabric(P * D)
    stage_fabrics = [Fabric(D) for _ in range(P)]
    logs = [[] for _ in engines]
    by_group: dict[int, list] = {}
    for r, e in enumerate(engines):
        e.set_layout(r // P, assignment)
        _log_backwards(e, logs[r])
        e.steps = _logged(e.steps, logs[r])
        by_group[id(stage_fabrics[r % P].groups[r // P])] = logs[r]
    # A send is logged when the exchange hands it over (its send thread starts it right after).
    post = exchange_module._Sender.post

    def logged_post(self, group, tensor, dst, tag):
        log = by_group.get(id(group))
        if log is not None:
            log.append(("stage_send", tensor.numel()))
        return post(self, group, tensor, dst, tag)

    monkeypatch.setattr(exchange_module._Sender, "post", logged_post)

    def worker(r: int, group) -> list:
        e = engines[r]
        links, exchanges = Links(), StageExchanges("owners")
        out = []
        for t in range(STEPS):
            out += drive(e.steps(t, 1), group=group, stage_group=stage_fabrics[r % P].groups[r // P],
                         grid=Grid(P, D, r), n_pieces=e.n_pieces, device=torch.device("cpu"), links=links,
                         exchanges=exchanges)
        return out

    results = run_ranks(generation, worker)
    for r in (0, 1):  # replica 0: partial (0, 2)'s units leave before micro-batch 2's backward
        for t in range(STEPS):
            start = logs[r].index(("begin", t))
            first_send = next(i for i in range(start, len(logs[r])) if logs[r][i][0] == "stage_send")
            assert logs[r].index(("open", t)) < first_send < _last_backward(logs[r], t, 3)
    ref_state, ref_losses = pm.unpipelined(job, STEPS, True)
    assert_state_equal(_state(engines), ref_state)
    assert [h.loss for h in results[0]] == ref_losses
    assert generation.undelivered() == 0 and all(f.undelivered() == 0 for f in stage_fabrics)


def test_a_tied_weights_gradients_leave_as_each_micro_batch_ends_and_bits_hold():
    job = pm.transformer_job(Pipeline(stages=P, schedule="1f1b"), virtual_nodes=4, model=pm.tied_gpt)
    job, engines = _engines(job, replicas=1)
    assert engines[0].ties is not None and engines[1].ties.parts_out  # worker 1 holds a copy the owner sums
    logs = [[] for _ in engines]
    for e, log in zip(engines, logs):
        _log_backwards(e, log)
        e.steps = _logged(e.steps, log)
    driver = LocalDriver(engines)
    driver.set_layout([list(range(4))])
    history = []
    for t in range(STEPS):
        history += driver.run(t, 1)
    for t in range(STEPS):  # the holder: one message per micro-batch, the first before its last backward
        sent = [i for i, x in enumerate(logs[1]) if x[0] == "tied" and x[1] == t]
        assert len(sent) == 4 and sent[0] < _last_backward(logs[1], t, 4)
    ref_state, ref_losses = pm.unpipelined(job, STEPS, True)
    assert_state_equal(_state(engines), ref_state)
    assert [h.loss for h in history] == ref_losses
