"""Sharded parameters in default mode against PyTorch's FSDP2 (``fully_shard``) on gloo.

The same job (tests/fsdp_jobs.py ``tied_gpt_job``: nanoGPT's ``GPT``, float32, output matrix tied
to the token embedding, AdamW groups chosen by shape, clipping at 0.05) trained for 3 steps on 2
worker processes by ``virtualflow.train(..., reduction="fsdp")`` and by the FSDP2 loop a PyTorch
user writes, below, from PyTorch's documented API only (no virtualflow code besides the public
``vn_seed``; the data order is tests/reference.py's ``step_batch``):

- ``fully_shard`` on every transformer block, then on the root (the tied matrix lives in the root's
  group, once); AdamW built over the sharded (DTensor) parameters;
- each rank runs its 4 of the 8 virtual nodes as micro-batches (gradient accumulation with a
  reduce-scatter per micro-batch, FSDP2's default), each VN's loss weighted ``n_v / B``, its batch
  the VN's slice of the step's global batch. The rank's VNs are those virtualflow's sharded engine
  gives it (rounds of consecutive VN ids: rank 0 runs 0, 2, 4, 6); any split sums the same 8
  gradients, only the order of the float additions differs;
- FSDP2 averages over the ranks by default; ``set_gradient_divide_factor(1.0)`` on every
  ``fully_shard`` module makes the reduce-scatter a SUM (the weights already carry ``n_v / B``),
  and ``set_force_sum_reduction_for_comms(True)`` keeps gloo on ``ReduceOp.SUM`` (without it
  FSDP2 asks for ``ReduceOp.PREMUL_SUM(1 / factor)``, and gloo raises "Cannot use
  ReduceOp.PREMUL_SUM with Gloo"; nothing else of the loop needs a workaround on gloo);
- ``torch.nn.utils.clip_grad_norm_`` over the DTensor gradients (the global norm), ``AdamW.step``;
- the whole weights by ``DTensor.full_tensor()``.

Measured (3 steps, this file's job): the largest difference between the two runs' weights is
7.5e-9 (float32 rounding; AdamW divides small gradients by their own root mean square, which
magnifies a last-bit difference). The bound, 1e-7, is ~13x that, and it tells the knobs apart:
FSDP2's default mean instead of the sum gives 1.6e-7 (only Adam's epsilon sees the scale),
contiguous blocks of VNs per rank (0-3 and 4-7: the same sum in another order) 1.2e-6, no clipping
3.4e-3. Both runs move every tensor of the model at least 100x the bound from its initial value.
Run: ``PYTHONPATH=src OMP_NUM_THREADS=1 python -m pytest -q -s tests/e2e/test_fsdp_vs_fsdp2.py``
(prints the measured difference; about 20 s on 2 cores).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch

import virtualflow as vf

STEPS = 3
WORLD = 2
MAX_NORM = 0.05
TOL = 1e-7
"""Bound on the weights' largest absolute difference (measured 7.5e-9: see the module docstring)."""


def job() -> vf.Job:
    from fsdp_jobs import tied_gpt_job

    return tied_gpt_job(max_grad_norm=MAX_NORM)


def rank_vns(rank: int, virtual_nodes: int, world: int) -> list[int]:
    """Round ``i`` runs VNs ``i*world .. i*world + world - 1``, one per rank."""
    return list(range(rank, virtual_nodes, world))


def fsdp2_worker(rank: int, port: int, out: str) -> None:
    """One FSDP2 rank: train ``job()`` for ``STEPS`` steps; rank 0 saves the whole weights and
    the step losses to ``out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from reference import step_batch

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    try:
        j = job()
        torch.manual_seed(j.seed)
        model = j.model()
        mesh = init_device_mesh("cpu", (WORLD,))
        shards = [fully_shard(block, mesh=mesh) for block in model.transformer.h]
        shards.append(fully_shard(model, mesh=mesh))
        for m in shards:
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
        opt = j.optimizer(model)
        ds = j.build_dataset()
        x_all, y_all = ds.tensors
        n, B, V = len(ds), j.global_batch_size, j.virtual_nodes
        losses = []
        model.train()
        for s in range(STEPS):
            idx = step_batch(j, n, s)
            opt.zero_grad()
            total = torch.zeros(())
            for v in rank_vns(rank, V, WORLD):
                sl = idx[v * (B // V) : (v + 1) * (B // V)]
                torch.manual_seed(vf.vn_seed(j.seed, s, v))
                loss = j.loss(model, (x_all[sl], y_all[sl])) * (len(sl) / B)
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            dist.all_reduce(total)
            losses.append(float(total))
        whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({"model": whole, "losses": losses}, out)
    finally:
        dist.destroy_process_group()


def run_fsdp2(tmp_path) -> dict:
    """Both FSDP2 ranks as child processes on a store this process hosts (port chosen by the OS);
    every child is reaped, pass or fail."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    out = str(tmp_path / "fsdp2.pt")
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.dirname(os.path.dirname(os.path.abspath(vf.__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(here), src, os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r), str(store.port), out], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(WORLD)]
    logs = []
    try:
        deadline = time.monotonic() + 90
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return torch.load(out, weights_only=True)


@pytest.mark.timeout(120)
def test_default_mode_matches_fsdp2_fully_shard_on_gloo(tmp_path):
    j = job()
    torch.manual_seed(j.seed)
    initial = j.model().state_dict()
    ours = vf.train(j, workers=WORLD, steps=STEPS, reduction="fsdp", run_dir=str(tmp_path / "run"))
    theirs = run_fsdp2(tmp_path)
    got, ref = ours.state_dict, theirs["model"]
    assert got.keys() == ref.keys() == initial.keys()
    diff = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    print(f"max |virtualflow - FSDP2| over the weights: {diff:.3g}")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=TOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    for state in (got, ref):  # every tensor trained far beyond the bound
        assert min(float((state[k] - initial[k]).abs().max()) for k in ref) > 100 * TOL
    torch.testing.assert_close([h["loss"] for h in ours.history], theirs["losses"], atol=1e-6, rtol=0)


if __name__ == "__main__":
    fsdp2_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    # The rank is done (its weights are saved, its group destroyed): leave without the interpreter's
    # teardown. Once in a local CI run (2026-11-30) a rank aborted after its last collective (the
    # other rank ended cleanly) with "terminate called without an active exception", the message
    # of a native thread ended by the interpreter's finalization, which failed the comparison.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
