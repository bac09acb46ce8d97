"""A batch change asked while a job runs (the cluster service's elastic-batch decisions): the
request path, the in-place change at a step boundary, its ``batch`` record and its replay.

The run is checked against the plain PyTorch loop of ``test_batch_schedule`` (written from the
documented rules), which changes V at the same steps: a change asked at the boundary before step
``s`` is the change ``(s, V)`` written in ``Job.batch_schedule``, bit for bit in deterministic mode.
"""

from __future__ import annotations

import json

import pytest
import torch

from jobs import regression_job
from test_batch_schedule import SCHEDULE, STEPS, reference, scheduled_job
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.launching.requests import ResizeRequests
from virtualflow.plan.batch_schedule import schedule_from_events
from virtualflow.runtime.grid_threads import Generation, train_threads
from virtualflow.runtime.step_boundary import apply_commands
from virtualflow.runtime.vn_worker import VNWorkerEngine

GENERATIONS = [Generation(members=(0, 1), steps=5), Generation(members=(0, 1, 2), steps=STEPS - 5)]
"""Two workers, then a third joins at step 5, after the change to V=16 (it receives the change)."""


def _commands_at_boundaries(monkeypatch, commands: dict[int, dict]) -> None:
    """Every worker reads ``commands[s]`` at the boundary before step ``s`` (as a worker's loop
    does with the control commands the step's reduction carried)."""
    step = VNWorkerEngine.step

    def stepping(self, s, control=0):
        if s in commands:
            apply_commands(self, [commands[s]], worker=0, step=s)
        return step(self, s, control)

    monkeypatch.setattr(VNWorkerEngine, "step", stepping)


class _Store:
    def queue_len(self, queue):
        return 0  # no signed request from outside


class _Coordinator:
    store, rejects = _Store(), None

    def __init__(self) -> None:
        self.progress = type("P", (), {"step": 0})()
        self.commands: list[tuple[str, dict]] = []
        self.events: list[dict] = []

    def command(self, op, **fields):
        self.commands.append((op, fields))

    def event(self, kind, **fields):
        self.events.append({"event": kind, **fields})


class _Controller:
    def __init__(self, members: int) -> None:
        self.target, self.members, self.busy, self.V = members, list(range(members)), False, 4
        self.speed_policy = type("S", (), {"V": 4, "B": 16})()

    def request_resize(self, workers, source):
        self.target = workers


class _Backend:
    def check_capacity(self, workers):
        pass


@pytest.fixture(scope="module")
def changed_run():
    """A plain job (no schedule) whose batch is changed by commands before steps 3 and 7."""
    mp = pytest.MonkeyPatch()
    try:
        _commands_at_boundaries(mp, {s: {"op": "batch", "virtual_nodes": v, "lr_rule": json.dumps("sqrt")}
                                     for s, v in SCHEDULE})
        job = regression_job("sgd", virtual_nodes=4, global_batch_size=16)
        return train_threads(job, GENERATIONS, options=WorkerOptions(deterministic=True))
    finally:
        mp.undo()


def test_a_batch_changed_at_step_boundaries_is_the_plain_loop_that_changes_v_there(changed_run):
    ref, _ = reference(scheduled_job(), STEPS, tree=True)
    for k, v in ref.items():
        assert torch.equal(changed_run.state["model"][k], v), k
    # the joiner ran the changed V: every engine holds the whole schedule, the checkpoint records it
    assert [e.batch.schedule.changes for e in changed_run.engines] == [tuple(SCHEDULE)] * 3
    assert changed_run.state["batch_schedule"] == [list(c) for c in SCHEDULE]


def test_the_request_path_records_the_step_it_applied_at_and_the_records_replay_the_run(changed_run):
    coord, ctl = _Coordinator(), _Controller(members=2)
    job = regression_job("sgd", virtual_nodes=4, global_batch_size=16)
    requests = ResizeRequests(job, 1, "token", "job", coord, _Backend(), ctl, lambda: None)
    coord.progress.step = 2
    requests.ask_batch(16, "sqrt")
    requests.ask(4)  # a grow asked after the larger batch: beyond the job's V=4 only with it
    requests.take()
    assert coord.commands == [("batch", {"virtual_nodes": 16, "lr_rule": '"sqrt"'})]
    assert ctl.target == 4 and ctl.V == 16
    # nothing is recorded before a worker has run a step at the new batch; then its step is
    requests.observe([{"type": "step", "step": 2, "samples": 16}])
    assert coord.events == []
    requests.observe([{"type": "step", "step": 3, "samples": 64}])
    assert coord.events == [{"event": "batch", "step": 3, "virtual_nodes": 16, "global_batch_size": 64,
                             "lr_multiplier": 2.0, "lr_rule": "sqrt"}]
    # a smaller batch than the members waits for the shrink asked before it
    ctl.members = [0, 1, 2, 3]
    coord.progress.step = 6
    requests.ask(3)
    requests.ask_batch(3, "sqrt")
    requests.take()
    assert len(coord.commands) == 1 and len(requests) == 1
    ctl.members = [0, 1, 2]
    requests.take()
    assert coord.commands[-1] == ("batch", {"virtual_nodes": 3, "lr_rule": '"sqrt"'}) and len(requests) == 0
    requests.observe([{"type": "step", "step": 7, "samples": 12}])
    # replaying the records (a job rebuilt from them) repeats the changed run bit for bit
    log = [{"event": "start"}, *coord.events]
    schedule, rule = schedule_from_events(log)
    assert (schedule, rule) == (SCHEDULE, "sqrt")
    replay = regression_job("sgd", virtual_nodes=4, global_batch_size=16, batch_schedule=schedule, lr_rule=rule)
    again = train_threads(replay, GENERATIONS, options=WorkerOptions(deterministic=True))
    for k, v in changed_run.state["model"].items():
        assert torch.equal(again.state["model"][k], v), k


@pytest.mark.parametrize("virtual_nodes, rule, message", [
    (8, {16: 1.0}, r"^Job.lr_rule has no multiplier for batch sizes \[32\] that Job.batch_schedule runs"),
    (8, "cubic", r"^Job.lr_rule='cubic' must be 'linear', 'sqrt'"),
    (0, "sqrt", r"^Job.batch_schedule change \(3, 0\) has virtual_nodes=0; a step needs at least one"),
])
def test_a_bad_batch_change_is_refused_in_one_line(virtual_nodes, rule, message):
    coord = _Coordinator()
    coord.progress.step = 2
    requests = ResizeRequests(regression_job("sgd", virtual_nodes=4, global_batch_size=16), 1, "t", "j", coord,
                              _Backend(), _Controller(members=2), lambda: None)
    with pytest.raises(ValueError, match=message):
        requests.ask_batch(virtual_nodes, rule)
    requests.ask_batch(8, "linear")
    requests.take()  # issued: the run's rule is 'linear' from now on
    with pytest.raises(ValueError, match=r"^batch change with lr_rule='sqrt' refused: the run's rule is 'linear'"):
        requests.ask_batch(2, "sqrt")
