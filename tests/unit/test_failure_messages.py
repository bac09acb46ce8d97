"""What a failed run tells its user (issue 40, item 16): where the logs are on the backend the
workers ran on, "fenced out" rather than "killed" for a worker this coordinator cannot stop, the
way on from a checkpoint that exists rather than the knob that would have written one, every
lost worker named, and the membership's "finished" step of a resumed run. In-process: the
message builders, the liveness check and the controller with a fake launcher."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import virtualflow as vf
from virtualflow.backends.external import ExternalBackend
from virtualflow.backends.local import LocalBackend
from virtualflow.control.coordinator import Coordinator
from virtualflow.control.membership import JobFailed, MembershipController
from virtualflow.control.membership.liveness import Liveness
from virtualflow.control.membership.sizing import decide_loss
from virtualflow.launching.outcome import job_failed_message, worker_failure

from control_fakes import FakeLauncher

ERROR = {"worker": 1, "pid": 4242, "error": "RuntimeError: boom", "traceback": "tb", "step": 3}


def _setup(backend, tmp_path):
    return SimpleNamespace(state_dir=str(tmp_path), run_dir=str(tmp_path), backend=backend)


def test_external_workers_failure_does_not_point_to_a_logs_folder(tmp_path):
    external = ExternalBackend(("127.0.0.1", 0))
    msg = str(worker_failure([ERROR], _setup(external, tmp_path)))
    assert msg.startswith("worker 1 (pid 4242) failed: RuntimeError: boom (at step 3; ")
    assert "logs" not in msg.replace("each external worker's output", "")
    assert "each external worker's output is on the console of the machine it runs on" in msg
    local = LocalBackend()
    local.state_dir = str(tmp_path)
    assert f"logs in {tmp_path}/logs" in str(worker_failure([ERROR], _setup(local, tmp_path)))


class _Store:
    def add(self, key: str, amount: int) -> int:
        return 0  # nobody beats


def test_a_silent_external_worker_is_fenced_out_not_killed():
    external = ExternalBackend(("127.0.0.1", 0))
    external.start_worker(0)  # a slot (filled by a join elsewhere)
    live = Liveness(external, _Store(), heartbeat_timeout_s=10.0)
    live.joined(0, now=0.0)
    (cause,) = live.judge(now=11.0, finished=False).values()
    assert cause.startswith("stopped responding (no heartbeat for 11.0 s); fenced out")
    assert "killed" not in cause and 0 in live.fenced




def formed(g: int, members: list[int], step: int = 0) -> dict:
    return {"type": "formed", "generation": g, "members": members, "step": step, "group_s": 0, "transfer_s": 0,
            "bytes": 0, "source": None, "receivers": []}


def _controller(last_step: int = 0, steps: int = 100):
    coord = Coordinator(total_steps=steps, run_dir=None)
    events: list[tuple[str, dict]] = []
    coord.event = lambda kind, **f: events.append((kind, f))  # type: ignore[method-assign]
    launcher = FakeLauncher()
    ctl = MembershipController(coord, launcher, vf.LaunchOptions(workers=2, steps=steps), virtual_nodes=8,
                               clock=lambda: 0.0, last_step=last_step)
    ctl.start()
    ctl.tick([{"type": "join", "worker": w, "setup_s": 0.0} for w in range(2)] + [formed(0, [0, 1], last_step)])
    return ctl, launcher, events


def test_no_worker_left_points_to_the_checkpoint_that_exists_not_the_knob():
    args = dict(members=[0, 1], failed={0: "x", 1: "y"}, pids={0: 1, 1: 2}, stages=None, replace_failed=False,
                target=2, min_workers=1, step=7)
    assert "checkpoint_every=" in decide_loss(**args).message  # nothing to continue from: the knob
    d = decide_loss(**args, checkpointed=True)
    assert "checkpoint_every" not in d.message and "continue it from its last checkpoint" in d.message
    assert "--resume RUN_DIR" in d.message
    # the controller knows: a checkpoint report, or a resumed run
    for last_step, reports in ((0, [{"type": "checkpoint", "worker": 0, "step": 4, "path": "p", "save_s": 0.1}]),
                               (50, [])):
        ctl, launcher, _ = _controller(last_step)
        ctl.tick(reports)
        launcher.codes.update({0: 1, 1: 1})
        with pytest.raises(JobFailed) as info:
            ctl.tick([])
        assert "checkpoint_every" not in str(info.value) and "--resume RUN_DIR" in str(info.value)


def test_every_lost_worker_is_named_when_they_fail_one_after_the_other(tmp_path):
    ctl, launcher, _ = _controller()
    launcher.codes[1] = -9
    ctl.tick([])  # worker 1 lost: the job goes on with worker 0
    ctl.tick([formed(1, [0], 3)])
    launcher.codes[0] = 1
    with pytest.raises(JobFailed) as info:
        ctl.tick([])
    assert "worker 1" not in str(info.value)  # the controller's reason names the last loss only
    msg = job_failed_message(info.value, ctl.failures, launcher, _setup(launcher, tmp_path))
    assert msg.startswith("worker 0 (pid 1000) exited with code 1 at step 3")
    assert "lost before that: worker 1 (pid 1001) was killed by SIGKILL in generation 0" in msg
    assert "(logs in RUN/logs)" in msg
    assert "worker 1's last output:\nlast line of worker 1" in msg and "worker 0's last output" in msg


def test_finished_records_the_last_step_even_when_another_members_done_comes_first():
    ctl, _, events = _controller(last_step=390, steps=400)
    ctl.tick([{"type": "step", "worker": 0, "step": 398, "generation": 0}])
    # worker 1's done is read before rank 0's report of step 399
    ctl.tick([{"type": "done", "worker": 1, "rank": 1, "step": 400}])
    finished = [f for k, f in events if k == "membership_phase" and f["phase"] == "finished"]
    assert [f["step"] for f in finished] == [400]
