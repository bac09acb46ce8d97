"""Models, jobs and plain-PyTorch references for the pipeline executor tests
(``tests/test_pipeline_engine.py``).

The references use no virtualflow code besides the public ``vn_seed`` and the schedules' action
lists (which the asynchronous reference walks to learn which weight version each micro-batch's
forward sees). They re-derive the data order, the VN slices and the fixed VN-id reduction tree
from their documented definitions.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf
from virtualflow.comm.groups import Group
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.engine import BatchLoader, VNEngine

from reference import step_batch

FEATURES = 8
VOCAB, SEQ, WIDTH = 11, 6, 16


# ---- data -------------------------------------------------------------------------------------
def regression_data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1, keepdim=True) - x[:, 3:4]).tanh())


def token_data(n: int = 72) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(x, (x * 3 + 1) % VOCAB)  # a per-token map the model can learn


# ---- models (nn.Sequential: the children are the layers cut into stages) ------------------------
def mlp(bn: bool = False) -> nn.Sequential:
    """9 layers (10 with BatchNorm), dropout in two places, parameterless layers in between."""
    layers: list[nn.Module] = [nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 16)]
    if bn:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 1)]
    return nn.Sequential(*layers)


def mlp_bn_everywhere() -> nn.Sequential:
    """BatchNorm on several pieces (so each stage has running statistics of its own)."""
    return nn.Sequential(
        nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 12), nn.BatchNorm1d(12), nn.Linear(12, 1),
    )


def transformer() -> nn.Sequential:
    """6 layers: embedding, 3 encoder layers (dropout, LayerNorm inside), LayerNorm, head."""
    def enc() -> nn.Module:
        return nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=24, dropout=0.1, batch_first=True)

    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), enc(), enc(), enc(), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))


class _TokensAndPositions(nn.Module):
    """GPT's input layer: token embedding (``tok.weight``, tied to the head) + learned positions."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tok(x) + self.pos[: x.shape[1]])


class _CausalBlock(nn.Module):
    """A pre-LayerNorm GPT block: causal self-attention and an MLP, dropout on both."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def tied_gpt() -> nn.Sequential:
    """6 layers, GPT-like: tokens + positions, 3 causal blocks, LayerNorm, a head whose weight IS
    the token embedding's (layer 0's ``tok.weight`` = layer 5's ``weight``)."""
    first = _TokensAndPositions()
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = first.tok.weight
    return nn.Sequential(first, _CausalBlock(), _CausalBlock(), _CausalBlock(), nn.LayerNorm(WIDTH), head)


# ---- jobs ---------------------------------------------------------------------------------------
def _mse(out, batch):
    return nn.functional.mse_loss(out, batch[1])


def _token_ce(out, batch):
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), batch[1].reshape(-1))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def _adamw(params):
    # eps well above rounding noise: attention's key-projection bias has a mathematically zero
    # gradient, and Adam with a tiny eps turns its rounding noise (which depends on the order of
    # summation, so differs in default mode) into +-lr steps. Deterministic mode is bit-identical
    # with any eps; this keeps default-mode comparisons meaningful at a tight tolerance.
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.05, eps=1e-4)


def _warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9 ** s)


OPTIMIZERS: dict[str, Callable] = {"sgd": _sgd, "adam": _adam, "adamw": _adamw}
PER_VN = 4  # samples per virtual node: B = PER_VN * V


def mlp_job(pipeline, *, virtual_nodes: int, bn: bool = False, batchnorm: str = "mean",
            optimizer: str = "sgd", scheduler: bool = False, model=None, seed: int = 0) -> vf.Job:
    return vf.Job(
        model=model or (lambda: mlp(bn)), optimizer=OPTIMIZERS[optimizer], output_loss=_mse,
        dataset=regression_data, global_batch_size=PER_VN * virtual_nodes, virtual_nodes=virtual_nodes,
        seed=seed, pipeline=pipeline, batchnorm=batchnorm, lr_scheduler=_warmup if scheduler else None,
    )


def transformer_job(pipeline, *, virtual_nodes: int, seed: int = 0, model=None) -> vf.Job:
    return vf.Job(
        model=model or transformer, optimizer=_adamw, output_loss=_token_ce, lr_scheduler=_warmup,
        dataset=token_data, global_batch_size=2 * virtual_nodes, virtual_nodes=virtual_nodes, seed=seed,
        pipeline=pipeline,
    )


# ---- the unpipelined run: the VN engine in-process on one worker ---------------------------------
def unpipelined(job: vf.Job, steps: int, deterministic: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same job without its pipeline, run by the VN engine on one worker (all V VNs)."""
    job = job.replace(pipeline=None)
    ds = job.build_dataset()
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    sched = job.lr_scheduler(opt) if job.lr_scheduler else None
    eng = VNEngine(model, opt, sched, job.compute_loss,
                   DataPlan(len(ds), job.global_batch_size, job.virtual_nodes, job.seed), BatchLoader(ds, None),
                   seed=job.seed, batchnorm=job.batchnorm, deterministic=deterministic, device=torch.device("cpu"),
                   precision=job.precision, max_grad_norm=job.max_grad_norm, loss_scale=job.loss_scale)
    eng.set_membership(Group(0, 0, 1, None), [list(range(job.virtual_nodes))])
    losses = [eng.step(s).loss for s in range(steps)]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


# ---- no-flush schedules: an independent reference of the stated weight laws ----------------------
def tree_sum(leaves: dict[int, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """The fixed VN-id tree of deterministic mode: node(lo, hi) = node(lo, mid) + node(mid, hi),
    mid = (lo + hi) // 2 (docs; virtualflow.plan.vnmap)."""
    if hi - lo == 1:
        return leaves[lo]
    mid = (lo + hi) // 2
    return tree_sum(leaves, lo, mid) + tree_sum(leaves, mid, hi)


def contiguous(virtual_nodes: int, replicas: int) -> list[list[int]]:
    base, extra = divmod(virtual_nodes, replicas)
    out, start = [], 0
    for j in range(replicas):
        n = base + (1 if j < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def versions_2bw(steps: int, virtual_nodes: int, stages: int) -> dict[tuple[int, int, int], int]:
    """2BW: every micro-batch of step t, on every stage, uses the weights after max(t-1, 0) updates."""
    return {(t, v, s): max(t - 1, 0) for t in range(steps) for v in range(virtual_nodes) for s in range(stages)}


def versions_async(steps: int, assignment: Sequence[Sequence[int]], stages: int,
                   window: int) -> dict[tuple[int, int, int], int]:
    """Asynchronous PipeDream: the version (update count) stage s holds when micro-batch i's forward
    runs, walking each window's action list; stage s applies step t's update right after its last
    backward of step t. The pipeline drains at every window end (all updates applied)."""
    from virtualflow.plan.pipeline import pipedream_async

    out: dict[tuple[int, int, int], int] = {}
    for vns in assignment:
        m = len(vns)
        t0 = 0
        while t0 < steps:
            n = min(window, steps - t0)
            sch = pipedream_async(stages, m, n)
            for s in range(stages):
                updates, done = t0, Counter()
                for a in sch.actions[s]:
                    assert a.stage == s
                    t = t0 + a.microbatch // m
                    if a.kind == "F":
                        out[t, vns[a.microbatch % m], s] = updates
                    elif a.kind == "B":
                        done[t] += 1
                        if done[t] == m:
                            updates += 1
                assert updates == t0 + n
            t0 += n
    return out


def stream_reference(job: vf.Job, steps: int, split: Sequence[int], version: dict[tuple[int, int, int], int], *,
                     deterministic: bool) -> tuple[dict[str, torch.Tensor], list[float], dict[int, dict]]:
    """Train ``job`` so that, on stage ``s``, VN ``v`` of step ``t`` computes its loss and gradient
    with stage ``s``'s weights after ``version[t, v, s]`` updates; update ``t`` of every stage sums
    the gradients of step ``t``'s VNs (in the fixed VN-id tree order when ``deterministic``,
    else in VN order) and steps the optimizer (and the LR scheduler) once.

    Returns the final state dict, the per-step losses and every weight version (update count ->
    parameters)."""
    torch.manual_seed(job.seed)
    model = job.model()
    model.train()
    stage_of_layer = [s for s, c in enumerate(split) for _ in range(c)]
    names = [n for n, _ in model.named_parameters()]
    stage_of = {n: stage_of_layer[int(n.split(".")[0])] for n in names}
    params = dict(model.named_parameters())
    opt = job.optimizer(model.parameters())
    sched = job.lr_scheduler(opt) if job.lr_scheduler else None
    ds = job.build_dataset()
    x_all, y_all = ds.tensors
    n, B, V = len(ds), job.global_batch_size, job.virtual_nodes
    history = {0: {k: q.detach().clone() for k, q in params.items()}}
    losses = []
    for t in range(steps):
        idx = step_batch(job, n, t)
        grads: dict[int, list[torch.Tensor]] = {}
        step_losses = []
        for v in range(V):
            sl = idx[v * (B // V): (v + 1) * (B // V)]
            weights = {k: history[version[t, v, stage_of[k]]][k].clone().requires_grad_(True) for k in names}
            torch.manual_seed(vf.vn_seed(job.seed, t, v))
            out = torch.func.functional_call(model, weights, (x_all[sl],))
            loss = job.output_loss(out, (x_all[sl], y_all[sl])) * (len(sl) / B)
            grads[v] = list(torch.autograd.grad(loss, list(weights.values())))
            step_losses.append(loss.detach())
        if deterministic:
            total = [tree_sum({v: grads[v][j] for v in range(V)}, 0, V) for j in range(len(names))]
        else:
            total = [grads[0][j].clone() for j in range(len(names))]
            for v in range(1, V):
                for j in range(len(names)):
                    total[j] += grads[v][j]
        for k, g in zip(names, total):
            params[k].grad = g.clone()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        history[t + 1] = {k: q.detach().clone() for k, q in params.items()}
        losses.append(float(torch.stack(step_losses).double().sum()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, history
