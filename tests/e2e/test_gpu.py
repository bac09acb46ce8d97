"""The CUDA paths: NCCL, two ranks on one GPU over gloo, bf16 autocast, compile, peak memory and
clipping on a GPU, each against a plain PyTorch loop written here.

Every test is marked ``gpu``: without a CUDA device tests/conftest.py skips them all with one
summary line. ``scripts/gpu-check.sh`` runs them (and the GPU parts of the benchmarks) on a
machine with one GPU; docs/gpu.md says which backend each result uses:

* NCCL: one rank only. NCCL refuses two ranks on the same device, so the multi-rank test on one
  GPU builds its group with **gloo over CUDA tensors** (gloo copies through the host).
* virtualflow's own groups (``comm/groups.py``) pick NCCL for CUDA and build no process group at
  all for a single worker, so ``virtualflow.train(device="cuda")`` with one worker runs no
  collective; the NCCL test below drives a one-rank NCCL group through virtualflow's ``Group``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf
from virtualflow.comm.groups import Group
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.vn_worker import VNWorkerEngine
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.worker_config import WorkerConfig

from reference import step_batch

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
IN, CLASSES = 16, 4


# --------------------------------------------------------------------------------------------
# The workload (module level: worker processes import it).


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, CLASSES))


def deep_model() -> nn.Module:
    """Activation-heavy (micro-batches of 8,192, 8 blocks of 256 -> 1024 -> 256): what checkpointing is for."""
    block = lambda: nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))  # noqa: E731
    return nn.Sequential(nn.Linear(IN, 256), *[block() for _ in range(8)], nn.Linear(256, CLASSES))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1024, IN, generator=g)
    return TensorDataset(x, (x @ torch.randn(IN, CLASSES, generator=g)).argmax(dim=1))


def big_data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16384, IN, generator=g)
    return TensorDataset(x, (x @ torch.randn(IN, CLASSES, generator=g)).argmax(dim=1))


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def loss(m: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(m(x), y)


def cuda_peak(m: nn.Module) -> dict[str, float]:
    """``Job.evaluate``: the worker's CUDA peak (allocated by tensors), read after the last step."""
    return {"cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20}


def job(**knobs) -> vf.Job:
    return vf.Job(model=model, optimizer=sgd, loss=loss, dataset=data, global_batch_size=64, virtual_nodes=4,
                  seed=0, name="gpu", **knobs)


def plain_cuda(j: vf.Job, steps: int, *, precision: str = "32", max_grad_norm: float | None = None):
    """The plain loop on CUDA: the job's sample order (tests/reference.py), ``torch.autocast``,
    ``clip_grad_norm_``. Returns the final weights (on the CPU) and each step's gradient norm."""
    torch.manual_seed(j.seed)
    m = j.model().to(CUDA)
    opt = j.optimizer(m.parameters())
    x_all, y_all = (t.to(CUDA) for t in j.build_dataset().tensors)
    B, V = j.global_batch_size, j.virtual_nodes
    dtype = {"32": None, "bf16-mixed": torch.bfloat16}[precision]
    norms = []
    for s in range(steps):
        idx = step_batch(j, len(x_all), s).to(CUDA)
        opt.zero_grad(set_to_none=True)
        for v in range(V):
            sl = idx[v * (B // V) : (v + 1) * (B // V)]
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                out = j.compute_loss(m, (x_all[sl], y_all[sl])) * (len(sl) / B)
            out.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), max_grad_norm)))
        opt.step()
    return {k: v.detach().cpu() for k, v in m.state_dict().items()}, norms


def close(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].float().cpu(), b[k].float().cpu(), rtol=rtol, atol=atol,
                                   msg=lambda msg, k=k: f"{k}: {msg}")


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


def engine_on(j: vf.Job, device: torch.device, group: Group, assignment, *, reduction: str = "allreduce",
              deterministic: bool = False) -> VNWorkerEngine:
    """virtualflow's VN engine for ``j`` in this process, built as a worker builds it."""
    cfg = WorkerConfig(store_host="127.0.0.1", store_port=0, job_source=None, total_steps=1 << 20,
                       state_dir="/nonexistent", overrides={}, threads=1, resume_path=None,
                       initial_workers=group.size, slowdowns={},
                       options=WorkerOptions(deterministic=deterministic, device=str(device), collective_timeout_s=60.0,
                                             control_plane=False, reduction=reduction, breakdown=False))
    ds = j.build_dataset()
    eng = VNWorkerEngine.build(j, ds, DataPlan(len(ds), j.global_batch_size, j.virtual_nodes, j.seed), cfg, device)
    eng.vn.set_membership(group, assignment)
    return eng


def cpu_state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}


# --------------------------------------------------------------------------------------------
# Process groups on one GPU.


def test_nccl_group_of_one_rank_reduces_cuda_tensors_through_virtualflows_group():
    """Backend: NCCL, 1 rank (the only NCCL group one GPU can hold). The raw process group, then
    virtualflow's :class:`Group` wrapper over it (blocking and asynchronous all-reduce, broadcast),
    as the engine's reducers call it."""
    assert dist.is_nccl_available()
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=60)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("gen/0", dist.HashStore()), 0, 1, opts)
    t = torch.arange(8, dtype=torch.float32, device=CUDA)
    pg.allreduce([t]).wait()
    group = Group(0, 0, 1, pg)
    group.all_reduce(t)
    assert group.all_reduce(t, async_op=True).wait()
    group.broadcast(t, src=0)
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.arange(8, dtype=torch.float32))
    if hasattr(pg, "shutdown"):
        pg.shutdown()


def _gloo_rank(rank: int, store_path: str, out_path: str, steps: int) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("gen/0", store), rank, 2, datetime.timedelta(seconds=120))
    j = job()
    eng = engine_on(j, CUDA, Group(0, rank, 2, pg), contiguous_assignment(j.virtual_nodes, 2))
    for s in range(steps):
        eng.step(s)
    if rank == 0:
        torch.save(cpu_state(eng.model), out_path)
    eng.close()


def test_two_ranks_on_one_gpu_over_gloo_with_cuda_tensors_train_the_one_worker_model(tmp_path):
    """Backend: gloo with CUDA tensors, 2 ranks on the same GPU (NCCL cannot share one device).
    Default mode (the bucketed all-reduce, which gloo runs on CUDA tensors; deterministic mode's
    tree uses point-to-point sends, which gloo does not do from device memory): the 2-worker model
    equals the 1-worker one within float tolerance."""
    steps = 4
    ctx = mp.get_context("spawn")
    store_path, out_path = str(tmp_path / "store"), str(tmp_path / "rank0.pt")
    procs = [ctx.Process(target=_gloo_rank, args=(r, store_path, out_path, steps)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0], "a gloo rank failed (see its stderr above)"

    one = engine_on(job(), CUDA, Group(0, 0, 1, None), [[0, 1, 2, 3]])
    for s in range(steps):
        one.step(s)
    close(torch.load(out_path), cpu_state(one.model), rtol=1e-5, atol=1e-6)
    one.close()


# --------------------------------------------------------------------------------------------
# The training loop's knobs on CUDA, through virtualflow.train, against the plain loop.


def test_bf16_autocast_on_cuda_matches_the_plain_autocast_loop(tmp_path):
    steps = 6
    r16 = vf.train(job(precision="bf16-mixed"), workers=1, steps=steps, device="cuda", run_dir=str(tmp_path / "bf16"))
    r32 = vf.train(job(), workers=1, steps=steps, device="cuda", run_dir=str(tmp_path / "fp32"))
    ref16, _ = plain_cuda(job(), steps, precision="bf16-mixed")
    ref32, _ = plain_cuda(job(), steps)
    close(r16.state_dict, ref16, rtol=1e-3, atol=1e-4)
    close(r32.state_dict, ref32, rtol=1e-4, atol=1e-5)
    assert max_diff(r16.state_dict, r32.state_dict) > 1e-6, "bf16-mixed trained exactly as fp32: autocast did nothing"
    assert all(v.dtype == torch.float32 for v in r16.state_dict.values()), "master weights must stay float32"


def test_clipping_on_cuda_matches_clip_grad_norm(tmp_path):
    steps, max_norm = 6, 0.05  # small enough that every step clips
    r = vf.train(job(max_grad_norm=max_norm), workers=1, steps=steps, device="cuda", run_dir=str(tmp_path / "clip"))
    ref, norms = plain_cuda(job(), steps, max_grad_norm=max_norm)
    assert min(norms) > max_norm
    close(r.state_dict, ref, rtol=1e-4, atol=1e-5)
    reported = [h.get("grad_norm") for h in r.history]
    assert None not in reported, f"each step's gradient norm is reported: {r.history[0]}"
    torch.testing.assert_close(torch.tensor(reported), torch.tensor(norms), rtol=1e-4, atol=1e-6)


def test_compile_on_cuda_compiles_once_and_trains_as_eager():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    steps = 5
    compiled = engine_on(job(compile=True), CUDA, Group(0, 0, 1, None), [[0, 1, 2, 3]])
    compiled.step(0)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1, "compile=True compiled nothing"
    for s in range(1, steps):
        compiled.step(s)
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled after the first step"
    assert sum(counters["recompiles"].values()) == 0
    eager = engine_on(job(), CUDA, Group(0, 0, 1, None), [[0, 1, 2, 3]])
    for s in range(steps):
        eager.step(s)
    close(cpu_state(compiled.model), cpu_state(eager.model), rtol=1e-4, atol=1e-5)
    compiled.close()
    eager.close()


def test_cuda_peak_memory_is_measured_in_the_worker_and_checkpointing_lowers_it(tmp_path):
    """The worker's CUDA peak (``torch.cuda.max_memory_allocated``, read through ``Job.evaluate``)
    with activation checkpointing off and on; the model trained is the same."""
    base = dict(model=deep_model, optimizer=sgd, loss=loss, dataset=big_data, global_batch_size=16384,
                virtual_nodes=2, seed=0, evaluate=cuda_peak, name="gpu-memory")
    off = vf.train(vf.Job(**base), workers=1, steps=2, device="cuda", run_dir=str(tmp_path / "off"))
    on = vf.train(vf.Job(**base, activation_checkpointing="every"), workers=1, steps=2, device="cuda",
                  run_dir=str(tmp_path / "on"))
    peak_off, peak_on = off.metrics["cuda_peak_mib"], on.metrics["cuda_peak_mib"]
    print(f"worker CUDA peak: checkpointing off {peak_off:.1f} MiB, on {peak_on:.1f} MiB")
    assert 0 < peak_on < 0.6 * peak_off
    # the run's own record of it (Result.peak_device_mib, from the worker's done report)
    assert off.peak_device_mib[0] >= peak_off and on.peak_device_mib[0] >= peak_on
    close(on.state_dict, off.state_dict, rtol=1e-4, atol=1e-5)


def wide_model() -> nn.Module:
    """Parameter-heavy (8 layers of 2048 x 2048, 34 M parameters): what sharded parameters are for."""
    layers = [nn.Linear(IN, 2048)] + [nn.Sequential(nn.Linear(2048, 2048), nn.GELU()) for _ in range(8)]
    return nn.Sequential(*layers, nn.Linear(2048, CLASSES))


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


def test_sharded_parameters_with_host_offload_on_cuda_lower_the_peak_and_train_the_same_model(tmp_path):
    """``reduction="fsdp", offload="cpu"`` on one GPU (one worker: no collective, so no NCCL): the
    parameter shards and Adam's state stay in host memory and each unit is copied to the GPU for
    its use, so the worker's CUDA peak is about the whole parameters once (the final state is
    gathered there) instead of parameters, gradients and two moments; the model trained is the
    same within the host and device kernels' rounding. Prints both peaks and step times."""
    base = dict(model=wide_model, optimizer=adam, loss=loss, dataset=data, global_batch_size=64, virtual_nodes=4,
                seed=0, name="gpu-fsdp")
    whole = vf.train(vf.Job(**base), workers=1, steps=3, device="cuda", run_dir=str(tmp_path / "whole"))
    off = vf.train(vf.Job(**base), workers=1, steps=3, device="cuda", reduction="fsdp", offload="cpu",
                   run_dir=str(tmp_path / "offload"))
    print(f"worker CUDA peak: whole {whole.peak_device_mib[0]:.1f} MiB, fsdp + offload {off.peak_device_mib[0]:.1f} "
          f"MiB; step time whole {whole.history[-1]['step_time_s']:.3f} s, offload {off.history[-1]['step_time_s']:.3f} s")
    assert 0 < off.peak_device_mib[0] < 0.5 * whole.peak_device_mib[0]
    close(off.state_dict, whole.state_dict, rtol=1e-4, atol=1e-5)
