"""``reduction="sharded"`` with a pipeline in worker processes (one short run, gloo): the stage
groups' reduce-scatter and all-gather, the gather of each stage's optimizer state for a checkpoint
and the final state, and a resume that cuts it into chunks again. The semantics are proven
in-process (``test_pipeline_sharded.py``).

2 stages x 2 replicas, deterministic (BatchNorm, dropout, SGD with momentum, an LR schedule):
bit-identical to the unpipelined deterministic run on one worker, the final state's optimizer
state equal to the unpipelined one's, each worker holding about half of its stage's optimizer
state, and rank 0 reporting every stage's step breakdown; resumed from its final state (cut into
chunks again, over 2 replicas) it continues exactly.
"""

from __future__ import annotations

import pytest
import torch

import virtualflow as vf
from conftest import assert_state_equal
import jobs
import pipeline_models as pm
from virtualflow.backends.inprocess import train_local


def test_sharded_pipeline_in_processes_bit_identical_checkpoint_and_resume(tmp_path):
    first = str(tmp_path / "first")
    job = jobs.pipelined_job()
    result = vf.train(jobs.pipelined_job, workers=4, steps=4, deterministic=True, reduction="sharded", run_dir=first)
    # the references in-process: the unpipelined job (the VN engine on one worker), and the same
    # pipeline without sharding (each stage's whole optimizer state)
    ref4, ref_losses = pm.unpipelined(job, 4, deterministic=True)
    assert_state_equal(result.state_dict, ref4)
    assert [h["loss"] for h in result.history] == ref_losses
    plain: list = []
    train_local(job, 4, replicas=2, deterministic=True, engines_out=plain)
    stages = result.optimizer_state_dict["pipeline_stages"]  # gathered over each stage's replicas
    for s, opt in enumerate(stages):
        whole = plain[s].optimizer.state_dict()["state"]
        assert opt["state"].keys() == whole.keys()
        for i in whole:
            assert torch.equal(opt["state"][i]["momentum_buffer"], whole[i]["momentum_buffer"])
    # each worker held its chunk of its stage's state (about half), not the stage's whole state
    per_stage = [sum(st["momentum_buffer"].numel() * 4 for st in opt["state"].values()) for opt in stages]
    held = result.optimizer_bytes
    assert sorted(held) == [0, 1, 2, 3] and all(0 < b < 0.6 * max(per_stage) for b in held.values())
    # the step breakdown, per stage (test_pipeline_breakdown.py): every worker's parts on rank 0
    from virtualflow.runtime import breakdown
    rows = [h for h in result.history if h.get("breakdown")]
    assert [h["breakdown_step"] for h in rows] == list(range(len(rows))) and len(rows) >= 2
    for h in rows:
        assert sorted(p["worker"] for p in h["breakdown"]) == [0, 1, 2, 3]
        for p in h["breakdown"]:
            assert sum(p[k] for k in breakdown.PARTS) == pytest.approx(p["step_s"], rel=1e-6, abs=1e-9)
            assert p["forward_s"] > 0 and p["backward_s"] > 0 and p["p2p_s"] > 0
    # resumed from the final state: the whole state is cut into chunks again
    resumed = vf.train(jobs.pipelined_job, workers=4, steps=6, deterministic=True, reduction="sharded", resume=first)
    assert [h["step"] for h in resumed.history][-2:] == [4, 5]
    assert_state_equal(resumed.state_dict, pm.unpipelined(job, 6, deterministic=True)[0])
