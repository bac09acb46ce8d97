"""The executor of communication programs on gloo ranks equals the p-rank simulator.

Two launches: 2 ranks (the data-parallel Adam step and the tensor-parallel MLP, each as written
and after every prefix of its rewrites, a broadcast program besides) and 4 ranks (the pipeline
boundary as 2 stages x 2 ranks, before and after its rewrites, and the Adam step and the MLP
over 4 ranks). Every rank runs the simulator itself on the same inputs and compares: its values
bit for bit (the simulator adds in the ring's order) and the bytes and messages it sent, op by
op. Only a small summary travels back to the test process.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import traceback

import pytest
import torch
import torch.distributed as dist

from virtualflow.plan.comm import rewrites, workloads
from virtualflow.plan.comm.build import Builder
from virtualflow.plan.comm.ir import Local, Replicated

TIMEOUT_S = 60.0


def _broadcast_program():
    b = Builder("bcast")
    x = b.input("x", (6, 3), Local())
    w = b.state("w", (6, 3), Replicated())
    y = b.broadcast(x, src=1, name="y")
    b.update(w, w + y)
    return b.build()


def _cases(world: int) -> list[tuple[str, object, str, int]]:
    """(case id, program builder, rewrites, ranks per stage)."""
    if world == 2:
        cases = [("bcast", _broadcast_program, "", 2)]
        for name in ("dp_adam", "tp_mlp"):
            chain = workloads.DEFAULT_REWRITES[name]
            for k in range(len(chain) + 1):
                cases.append((f"{name}:{','.join(chain[:k])}", workloads.WORKLOADS[name], ",".join(chain[:k]), 2))
        cases.append(("tp_mlp:overlap-rows", workloads.tp_mlp, "overlap", 2))  # chunks of rows + all_reduce
        # Uneven pieces: 7 rows and a 9-wide hidden layer on 2 ranks; a 1-element bias (an empty chunk).
        cases.append(("tp_mlp-odd", lambda: workloads.tp_mlp(seq=7, hidden=6, ffn=9), "split,reorder,fuse,overlap", 2))
        cases.append(("dp_adam-odd", lambda: workloads.dp_adam(((5, 3), (1,))), "split,reorder,fuse", 2))
        cases.append(("dp_adam-clip", lambda: workloads.dp_adam(clip=0.5), "split,reorder,fuse", 2))
        # Collectives along dim 1 (the hidden dim): pieces made contiguous in chunk order.
        cases.append(("tp_mlp:split-dim1", lambda: rewrites.reorder(rewrites.split(workloads.tp_mlp(), "y_sum", dim=1)),
                      "fuse", 2))
        return cases
    chain = workloads.DEFAULT_REWRITES["pipeline_boundary"]
    cases = [(f"pipeline_boundary:{','.join(chain[:k])}", workloads.pipeline_boundary, ",".join(chain[:k]), 2)
             for k in (0, 1, len(chain))]
    cases.append(("pipeline_boundary:boundary-only", workloads.pipeline_boundary, "boundary", 2))
    for name in ("dp_adam", "tp_mlp"):
        rw = ",".join(workloads.DEFAULT_REWRITES[name])
        cases.append((f"{name}@4:{rw}", workloads.WORKLOADS[name], rw, 4))
    return cases


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def test_executor_on_one_rank_equals_the_simulator():
    # A group of one (no process group): every collective is the identity and sends nothing.
    from virtualflow.comm.groups import Group
    from virtualflow.comm.program import execute
    from virtualflow.plan.comm.simulate import simulate

    for name in ("dp_adam", "tp_mlp"):
        prog = rewrites.apply(workloads.WORKLOADS[name](), workloads.DEFAULT_REWRITES[name])
        inputs = workloads.example_inputs(prog, 1, seed=3)
        res = execute(prog, inputs, Group(0, 0, 1, None))
        sim = simulate(prog, 1, inputs)
        for n, v in res.values.items():
            assert _same_bits(v, sim.values[n][0]), f"{name}: {n}"
        assert res.bytes_sent() == 0 and sim.bytes_per_rank() == [0]


def _worker(port: int, world: int, rank: int, out: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from virtualflow.comm.groups import make_group, make_subgroup
    from virtualflow.comm.program import execute
    from virtualflow.plan.comm.simulate import simulate

    summary: dict[str, object] = {}
    world_group = None
    try:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        cpu = torch.device("cpu")
        world_group = make_group(store, 0, rank, world, TIMEOUT_S, cpu)
        stage_groups = {}
        for case, build, rw, p in _cases(world):
            prog = rewrites.apply(build(), rw) if rw else build()
            stage, r = divmod(rank, p)
            if stage >= prog.stages:
                continue  # a rank outside this program (a 2-rank program run on 4 ranks)
            if prog.stages * p == world:
                group = world_group
                p2p = world_group if prog.stages > 1 else None
                if prog.stages > 1:
                    key = (p, stage)
                    if key not in stage_groups:
                        stage_groups[key] = make_subgroup(store, 0, f"p{p}s{stage}", r, p, TIMEOUT_S, cpu)
                    group = stage_groups[key]
            else:
                raise AssertionError(f"{case}: {prog.stages} stages x {p} ranks on a world of {world}")
            inputs = workloads.example_inputs(prog, p, seed=7)
            trace: list = []
            res = execute(prog, inputs, group, stage=stage, p2p=p2p, trace=trace)
            sim = simulate(prog, p, inputs)
            diffs = [n for n, v in res.values.items() if not _same_bits(v, sim.values[n][r])]
            sim_ops = [(rec.op, rec.bytes_sent[rank], rec.messages[rank]) for rec in sim.ledger
                       if rec.bytes_sent[rank] or rec.messages[rank]]
            exec_ops = [(t.op, t.bytes_sent, t.messages) for t in res.ledger if t.bytes_sent or t.messages]
            summary[case] = {"differ": diffs, "sim": sim_ops, "exec": exec_ops,
                             "names": sorted(res.values), "trace": trace}
        out.put((rank, summary, None))
    except BaseException:  # noqa: BLE001 - report to the test process
        out.put((rank, summary, traceback.format_exc()))
    finally:
        if world_group is not None:
            world_group.close()


def _launch(world: int) -> dict[int, dict]:
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(store.port, world, r, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        for _ in range(world):
            try:
                rank, summary, error = out.get(timeout=120)
            except queue.Empty:
                pytest.fail(f"a rank of {world} did not report within 120 s (got {sorted(results)})")
            assert error is None, f"rank {rank} failed:\n{error}"
            results[rank] = summary
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return results


def _check(results: dict[int, dict], world: int) -> None:
    cases = {c[0] for c in _cases(world)}
    for rank, summary in results.items():
        for case, s in summary.items():
            assert not s["differ"], f"rank {rank} {case}: values differ from the simulator's: {s['differ']}"
            assert s["exec"] == s["sim"], f"rank {rank} {case}: ledger {s['exec']} != simulator {s['sim']}"
    ran = set().union(*(set(s) for s in results.values()))
    assert ran == cases


@pytest.mark.slow
def test_executor_equals_simulator_on_2_ranks():
    results = _launch(2)
    _check(results, 2)
    # The Adam step after split + reorder: each rank sends (p-1)/p of the gradient for the
    # reduce-scatter and of the weights for the all-gather, nothing for the moments.
    n = 64 * 8 + 8
    for rank in (0, 1):
        s = results[rank]["dp_adam:split,reorder,fuse"]
        assert sum(b for _, b, _ in s["exec"]) == 2 * (n // 2) * 4
        assert [m for _, _, m in s["exec"]] == [1, 1]  # one bucket each way, p-1 = 1 message
    # The overlapped MLP: chunk 0's reduce-scatter is issued, chunk 1's matmul runs while it is in
    # flight, and it is waited on only where the concatenation reads it.
    trace = results[0]["tp_mlp:split,reorder,fuse,overlap"]["trace"]
    assert trace.index(("issue", "y_sum_slice_c0")) < trace.index(("run", "z_c1")) < \
        trace.index(("issue", "y_sum_slice_c1")) < trace.index(("wait", "y_sum_slice_c0")) < \
        trace.index(("run", "y_sum_slice"))


@pytest.mark.slow
def test_executor_equals_simulator_on_4_ranks_and_2_stages():
    results = _launch(4)
    _check(results, 4)
    # Pipeline boundary: stage 0 sends only its slice of the (8, 16) activations.
    for rank in (0, 1):
        before = dict((op.split(" = ")[1].split("(")[0], b) for op, b, _ in results[rank]["pipeline_boundary:"]["exec"])
        after = dict((op.split(" = ")[1].split("(")[0], b) for op, b, _ in
                     results[rank]["pipeline_boundary:split,reorder,boundary"]["exec"])
        assert before["send[->stage 1]"] == 8 * 16 * 4
        assert after["send[->stage 1]"] == 8 * 16 * 4 // 2
