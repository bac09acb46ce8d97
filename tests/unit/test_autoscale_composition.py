"""The autoscaler with the sharded reduction, loader threads, bf16 and clipping, and a lost peer:
its decisions applied as generations to VN engines running in threads (real gloo groups over an
in-process TCP store), trained bit-identical to one worker without any of the helpers.

The autoscale executor is the real one, with the ``efficiency`` policy; it reads a step report per
step (rank 0's outcome, with a step time fed from a fixed curve, so its decisions are
deterministic) and asks a stand-in controller for sizes; the harness applies each asked size as
the next generation at the following step boundary, as the membership controller does: the
members gather a sharded optimizer state (``before_regroup``) and a newcomer receives the whole
state before it joins. A lost peer closes its group mid-step; the survivors abandon the step,
adopt a generation without it and redo the step, and the executor, seeing the smaller size,
grows the job back.
"""

from __future__ import annotations

import copy
import datetime
import threading
import types

import pytest
import torch
import torch.distributed as dist

from virtualflow.comm.groups import Group, make_group
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.control.autoscale import EfficiencyPolicy, Limits
from virtualflow.control.autoscale_executor import AutoscaleExecutor
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.transfer import Progress
from virtualflow.runtime.vn_worker import VNWorkerEngine, full_state, load_full_state
from conftest import assert_state_equal
import jobs

CPU = torch.device("cpu")
STEP_S = {1: 1.0, 2: 0.5, 3: 0.4}
"""The step time each size reports: 1 -> 2 and 2 -> 3 both pay (scaling efficiency 1.0 and 0.5)."""


def loop_job():
    """A dropout-free MLP with bf16 autocast and a clip that acts (as tests/unit/test_composition.py's)."""
    return jobs.regression_job(precision="bf16-mixed", max_grad_norm=0.05)


def build(job, *, reduction: str, loader_workers: int):
    ds = job.build_dataset()
    cfg = types.SimpleNamespace(options=WorkerOptions(deterministic=True, reduction=reduction, shard_replicas=0,
                                                      deterministic_exchange="auto", loader_workers=loader_workers,
                                                      breakdown=True))
    return VNWorkerEngine.build(job, ds, DataPlan.of_job(job, len(ds)), cfg, CPU).vn


class Controller:
    """The membership controller as the executor sees it: members, the asked size, publishes."""

    def __init__(self, members: list[int]) -> None:
        self.members, self.target = list(members), len(members)
        self.busy = self.hold = self.finished = self.balance = False
        self.layout = None

    def request_resize(self, workers: int, source: str = "api") -> None:
        self.target = workers


class Events:
    def event(self, kind: str, **fields) -> None:
        pass


class Harness:
    """Engines by worker id; one generation at a time, each member stepping in its own thread."""

    def __init__(self, job, **knobs) -> None:
        self.job, self.knobs = job, knobs
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.engines: dict = {}  # worker id -> its VN engine
        self.groups: dict[int, Group] = {}
        self.members: list[int] = []
        self.generation = -1
        self.next_id = 0

    def regroup(self, members: list[int], step: int, planned: bool = True) -> None:
        """Generation ``g+1`` of ``members`` (new ids are newcomers, which get the whole state of
        the first member; a planned change gathers a sharded state first)."""
        if planned and self.members:
            self.in_threads(self.members, lambda w: self.engines[w].before_regroup())
        for w in self.members:
            self.groups.pop(w).close()
        old = [w for w in members if w in self.engines]
        for w in members:
            if w not in self.engines:
                self.engines[w] = build(self.job, **self.knobs)
                if old:
                    # (a copy: in one process the loaded optimizer state would share the source's tensors)
                    state = copy.deepcopy(full_state(self.engines[old[0]], Progress(step, 0)))
                    load_full_state(self.engines[w], state)
        self.generation += 1
        self.members = list(members)
        assignment = contiguous_assignment(self.job.virtual_nodes, len(members))
        n, g = len(members), self.generation

        def join(w: int) -> None:
            rank = members.index(w)
            client = dist.TCPStore("127.0.0.1", self.store.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
            self.groups[w] = make_group(client, g, rank, n, 3.0, CPU) if n > 1 else Group(g, 0, 1, None)
            self.engines[w].set_membership(self.groups[w], assignment)
        self.in_threads(members, join)

    def in_threads(self, workers: list[int], fn) -> list:
        results: dict[int, object] = {}

        def body(w: int) -> None:
            try:
                results[w] = fn(w)
            except BaseException as exc:  # noqa: BLE001 - returned to the caller
                results[w] = exc
        threads = [threading.Thread(target=body, args=(w,), daemon=True) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(results) == len(workers), "a worker thread did not finish in 120 s"
        return [results[w] for w in workers]

    def step(self, step: int) -> object:
        outs = self.in_threads(self.members, lambda w: self.engines[w].step(step))
        errors = [o for o in outs if isinstance(o, BaseException)]
        assert not errors, errors
        return outs[0]

    def lose(self, lost: int, step: int) -> None:
        """``lost`` drops out during ``step`` (its connections close); the others' step fails."""
        def body(w: int):
            if w == lost:
                self.groups[w].close()
                return None
            with pytest.raises(Exception):
                self.engines[w].step(step)
            self.engines[w].abandon_step()
        outs = self.in_threads(self.members, body)
        assert not [o for o in outs if isinstance(o, BaseException)], outs
        self.groups.pop(lost)
        self.engines.pop(lost).close()
        self.members.remove(lost)

    def report(self, step: int, out) -> dict:
        n = len(self.members)
        return {"type": "step", "step": step, "samples": self.job.global_batch_size, "step_time_s": STEP_S[n],
                "workers": n, "generation": self.generation, "members": list(self.members), "time": float(step),
                "vns": contiguous_assignment(self.job.virtual_nodes, n), "compute_s": [0.1] * n,
                "breakdown": out.breakdown}

    def close(self) -> dict:
        for w in self.members:
            self.groups.pop(w).close()
        states = {}
        for w, e in self.engines.items():
            e.close()
            states[w] = {k: v.detach().clone() for k, v in e.model.state_dict().items()}
        return states


def reference(job, steps: int):
    h = Harness(job, reduction="allreduce", loader_workers=0)
    h.regroup([0], 0)
    outs = [h.step(s) for s in range(steps)]
    return h.close()[0], outs


@pytest.mark.parametrize("reduction,lost_at", [("sharded", None), ("allreduce", 5)],
                         ids=["sharded", "allreduce-peer-lost"])
def test_autoscaler_grows_with_sharding_loaders_bf16_clipping_and_a_lost_peer_are_one_workers_model(
        reduction, lost_at):
    job = loop_job()
    steps = 8
    ref, ref_outs = reference(job, steps)
    h = Harness(job, reduction=reduction, loader_workers=2)
    ctl = Controller([0])
    ex = AutoscaleExecutor(EfficiencyPolicy(min_steps=2, warmup_steps=0), ctl, Events(), limits=Limits(1, 3),
                           global_batch_size=job.global_batch_size, virtual_nodes=job.virtual_nodes,
                           total_steps=steps, start_time=0.0, clock=lambda: 0.0)
    h.regroup([0], 0)
    h.next_id = 1
    outs, sizes = [], []
    for step in range(steps):
        if ctl.target != len(ctl.members):  # the asked size becomes the next generation
            grown = ctl.members + list(range(h.next_id, h.next_id + ctl.target - len(ctl.members)))
            h.next_id += ctl.target - len(ctl.members)
            h.regroup(grown, step)
            ctl.members = list(grown)
        if step == lost_at:
            h.lose(ctl.members[-1], step)
            h.regroup(list(h.members), step, planned=False)
            ctl.members, ctl.target = list(h.members), len(h.members)
        out = h.step(step)
        outs.append(out)
        sizes.append(len(h.members))
        ex.update([h.report(step, out)])
    states = h.close()
    for w in ctl.members:
        assert_state_equal(states[w], ref)
    assert [o.loss for o in outs] == [o.loss for o in ref_outs]
    assert [o.grad_norm for o in outs] == [o.grad_norm for o in ref_outs]
    assert min(o.grad_norm for o in outs) > job.max_grad_norm, "the clip never acted"
    if lost_at is None:
        assert sizes == [1, 1, 2, 2, 3, 3, 3, 3]
        assert [(d["from"], d["to"]) for d in ex.decisions] == [(1, 2), (2, 3)]
    else:  # 3 workers for one step, a peer lost, 2 survivors, grown back to 3 (3 measured there)
        assert sizes == [1, 1, 2, 2, 3, 2, 3, 3]
        assert [(d["from"], d["to"]) for d in ex.decisions] == [(1, 2), (2, 3), (2, 3)]
    assert ex.settled_at == 3
