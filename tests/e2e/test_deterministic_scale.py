"""Deterministic mode at scale: 1, 2, 3, 5, 7 and 8 workers, uneven VN maps, V = 16 and V = 12,
a SIGKILL in the middle of the exchange and a resize 2 -> 5 -> 3, all bit-identical to the
1-worker run.

The contract (docs/training.md, "Deterministic mode"): final weights, optimizer and LR-scheduler
state do not depend on the number of workers, on how the VNs are mapped onto them, nor on the
membership changes a run went through. The job (``jobs.mlp_and_lm_job``) trains a BatchNorm +
dropout MLP and a small transformer side by side (AdamW with groups, clipping by the step's
norm), so each run checks both: BatchNorm statistics and the loss ride the exchange, dropout
draws per VN, the clipping norm is summed across workers.

Worker processes are what these tests pay for (about 2.5 CPU-seconds each to start here), so one
run goes through every size: it starts on 8 workers, one of them SIGKILLs itself inside step 1's
exchange, the 7 survivors redo the step, and the run shrinks 7 -> 5 -> 3 -> 2 (shrinking starts
nothing); the V = 12 run then grows 2 -> 5 and shrinks to 3. Each size trains at least two
steps, and a run stops as soon as it has been through its sizes. V = 12 on 8, 7 and 5 workers
and V = 16 on 7, 5 and 3 give blocks of unequal sizes whose edges cut the reduction tree at
different depths. The V = 12 run uses the default exchange (``owners``), the V = 16 run the
``slots`` exchange, forced. The two runs go side by side (one's start-ups fill the other's idle
time), and they are paced (rank 0 sleeps after each step) so that they take a few dozen steps
while newcomers start; each 1-worker reference runs the same job unpaced for the same number of
steps, as soon as its run has stopped.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import virtualflow as vf
from virtualflow.records.rundir import read_jsonl
from conftest import assert_same_training, wait_for_step
import jobs

FOREVER = 1_000_000
VIRTUAL_NODES = (16, 12)
START, VICTIM = 8, 3
"""Every run starts on 8 workers; worker 3 SIGKILLs itself inside step 1's exchange."""
RESIZES = {16: (5, 3, 2), 12: (5, 3, 2, 5, 3)}
"""Then, from the 7 survivors: shrink to 5, 3, 2; the V = 12 run also grows 2 -> 5 and shrinks
to 3 (a grow starts workers: once is enough)."""
EXCHANGE = {16: "slots", 12: "auto"}
"""``deterministic_exchange`` of each run: the V = 12 run (the most uneven maps, the grow) the
default (``owners``), the V = 16 run today's first algorithm, forced: both must give the bits of
one worker (which exchanges nothing)."""
ALGORITHM = {"slots": "slots", "auto": "owners"}


def vn_counts(v: int, workers: int) -> list[int]:
    """VNs per rank of the default map: contiguous blocks, sizes differing by at most 1."""
    base, extra = divmod(v, workers)
    return [base + (1 if r < extra else 0) for r in range(workers)]


def sizes_in_order(history: list[dict]) -> list[int]:
    sizes = [h["workers"] for h in history]
    return [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n]


def wait_for_failure(handle, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not handle.controller.failures:
        assert time.monotonic() < deadline and not handle.done, "the planned SIGKILL did not happen"
        time.sleep(0.02)


def run_and_reference(v: int, run_dir: str, handles: dict) -> tuple[vf.Result, vf.Result]:
    """The V = ``v`` run through its sizes, stopped as soon as it has been through them; then its
    1-worker reference for the same number of steps."""
    plan = vf.FaultPlan([vf.Fault(worker=VICTIM, step=1, phase="during_reduction")])
    handle = handles[v] = vf.launch(jobs.mlp_and_lm_job(v, paced=True), workers=START, steps=FOREVER,
                                    deterministic=True, deterministic_exchange=EXCHANGE[v], fault_plan=plan,
                                    run_dir=run_dir)
    wait_for_failure(handle)
    wait_for_step(handle, 3)
    for n in RESIZES[v]:
        handle.resize(n, wait=True, timeout_s=120)
        wait_for_step(handle, handle.status()["step"] + 2)  # at least two steps at n
    result = handle.stop()
    return result, vf.train(jobs.mlp_and_lm_job(v), workers=1, steps=result.steps, deterministic=True)


def test_every_size_a_sigkill_and_resizes_train_what_one_worker_trains(tmp_path):
    # The two runs side by side (threads only drive them: each job's workers are processes).
    handles: dict[int, vf.JobHandle] = {}
    with ThreadPoolExecutor(len(VIRTUAL_NODES)) as pool:
        futures = {v: pool.submit(run_and_reference, v, str(tmp_path / f"v{v}"), handles) for v in VIRTUAL_NODES}
        try:
            runs = {v: f.result(timeout=300) for v, f in futures.items()}
        except BaseException:
            for h in list(handles.values()):
                h.kill()
            raise

    for v, (result, reference) in runs.items():
        assert [f["worker"] for f in result.failures] == [VICTIM] and "SIGKILL" in result.failures[0]["cause"]
        assert sizes_in_order(result.history) == [START, START - 1, *RESIZES[v]], v
        for h in result.history:  # every step ran every VN once, in the default map's blocks
            assert [len(vns) for vns in h["vns"]] == vn_counts(v, h["workers"])
            assert [u for vns in h["vns"] for u in vns] == list(range(v))
        chosen = {e["algorithm"] for e in read_jsonl(os.path.join(result.run_dir, "events.jsonl"))
                  if e["event"] == "exchange"}
        assert chosen == {ALGORITHM[EXCHANGE[v]]}, (v, chosen)
        assert_same_training(result, reference)
        # and the reference trained: the comparison is not between two runs that did nothing
        assert reference.history[-1]["loss"] < reference.history[0]["loss"]
