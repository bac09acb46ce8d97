"""The composition sweep: random combinations of 3-5 capabilities of docs/composition.md, each
trained 3 steps in deterministic mode on a small GPT with every worker as a thread (the real
engines over real gloo groups, :func:`virtualflow.runtime.grid_threads.train_threads`), and
checked against the single-worker unpipelined run of the same job.

What a draw is checked against comes from the table (:mod:`virtualflow.config.composition`), never
from a list of pairs written here:

- **refused**: a row of :data:`~virtualflow.config.composition.REFUSALS` whose two capabilities
  are in the draw and whose condition holds for the draw's facts: the launch
  (:func:`virtualflow.launching.prepare.prepare`, what ``vf.train`` runs before any worker starts)
  or the engine raises, and its message is one such row's (the exact text);
- **works** otherwise: bit-identical to the single-worker run (final weights, every step's loss
  and gradient norm) without tensor parallelism; with ``T > 1`` within the table's stated
  tolerance for the precision (``TOLERANCES``, keyed ``("tensor parallel", precision)``).

A capability enters the sweep by a row of :data:`CAPABILITIES` (how it is set on the job, the
options and the run's generations, and when it is in effect); the test fails for a capability of
the table without one, and for a refusal row whose condition needs a fact :func:`facts` does not
give. The draws are seeded: ``VIRTUALFLOW_SWEEP_SEED`` (default :data:`DEFAULT_SEED`, so that CI runs the
same draws every day; set another seed to explore, it is printed and named in every failure) and ``VIRTUALFLOW_SWEEP_DRAWS`` (default 40), plus :data:`HEAVIEST`, always run.

What is not exercised in-process: the autoscaler's policy itself (its decisions are tested in
tests/unit/test_autoscale*.py); here its decision is applied as what the executor makes of it, a
generation of another size in whole replicas. A failure drops the lost worker's whole replica, as
the membership controller does without Bamboo; with Bamboo the hit replica fails over, one worker
shorter, as the controller decides (its decision is computed here). A sharded optimizer state with no replica of the lost chunk stops the
run naming the way out (:class:`~virtualflow.runtime.sharded.ShardLost`), as docs/composition.md
says; an unpipelined sharded run keeps replicas (``shard_replicas=1``) and recovers.
"""

from __future__ import annotations

import inspect
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import virtualflow as vf
from virtualflow.config import composition as table
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.control.membership.failover import decide_failover
from virtualflow.launching.prepare import prepare
from virtualflow.parallel.gpt import sequential_gpt
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds, tied_parameters
from virtualflow.runtime import breakdown as parts
from virtualflow.runtime.grid_threads import Generation, train_threads
from virtualflow.runtime.sharded import ShardLost
from conftest import assert_state_equal
from gpt_grid_jobs import tokens
from nanogpt import GPT, GPTConfig

STEPS = 3
DEFAULT_SEED = 20261129
SEED = int(os.environ.get("VIRTUALFLOW_SWEEP_SEED", DEFAULT_SEED))
DRAWS = int(os.environ.get("VIRTUALFLOW_SWEEP_DRAWS", "40"))
print(f"composition sweep: seed {SEED} (VIRTUALFLOW_SWEEP_SEED), {DRAWS} draws (VIRTUALFLOW_SWEEP_DRAWS)")


# ---- the job: nanoGPT's GPT, small, float32, no dropout ----------------------------------------
def _model(tied: bool) -> torch.nn.Module:
    cfg = GPTConfig(block_size=8, vocab_size=40, n_layer=2, n_head=2, n_embd=16, dropout=0.0, flash=False)
    return sequential_gpt(GPT(cfg, tied=tied))


def _loss(logits, batch):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[1].reshape(-1))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _dataset():
    return tokens(n=32)


def job_of(k: Knobs) -> vf.Job:
    """The draw's job (a ``Pipeline`` when some capability needs one)."""
    pipeline = vf.Pipeline(stages=k.stages, tensor=k.tensor, redundancy=k.redundancy) if k.pipelined else None
    return vf.Job(model=lambda: _model(k.tied), optimizer=_sgd, dataset=_dataset, output_loss=_loss,
                  global_batch_size=8, virtual_nodes=4, seed=3, precision=k.precision,
                  max_grad_norm=k.max_grad_norm, pipeline=pipeline)


# ---- what each capability means: THE mapping ----------------------------------------------------
@dataclass
class Knobs:
    """A draw's layout, options and generations."""

    stages: int = 1
    tensor: int = 1
    replicas: int = 1
    reduction: str = "allreduce"
    shard_replicas: int = 0
    precision: str = "32"
    max_grad_norm: float | None = None
    tied: bool = False
    redundancy: bool = False
    loader_workers: int = 0
    breakdown: bool = False
    balance: bool = False
    autoscale: str | None = None
    changes: list[str] = field(default_factory=list)
    """Generation changes, in order: ``"lost"`` (a member lost mid-step; its replica leaves),
    ``"resize"`` (another replica count)."""

    @property
    def pipelined(self) -> bool:
        return self.stages > 1 or self.tensor > 1 or self.redundancy

    @property
    def replica_workers(self) -> int:
        return self.stages * self.tensor


@dataclass(frozen=True)
class Capability:
    """How a capability is set (``on_knobs``: on the draw's knobs, with the draw's generator) and
    when it is in effect (``present``: a refusal row applies only when both of its capabilities are)."""

    on_knobs: Callable[[Knobs, random.Random], None]
    present: Callable[[Knobs], bool]


def _set(**values: Any) -> Callable[[Knobs, random.Random], None]:
    """Set knobs (``stages`` and ``replicas``: at least the value, another capability may want more)."""
    def apply(k: Knobs, rng: random.Random) -> None:
        for name, v in values.items():
            setattr(k, name, max(getattr(k, name), v) if name in ("stages", "replicas") else v)
    return apply


def _resize(k: Knobs, rng: random.Random) -> None:
    k.changes.append("resize")


def _autoscale(k: Knobs, rng: random.Random) -> None:
    k.autoscale = "efficiency"
    k.changes.append("resize")  # its decision, as the executor applies it: a generation of another size


def _failure(k: Knobs, rng: random.Random) -> None:
    k.changes.insert(0, "lost")  # first: from two replicas to the survivor's one


def _precision(k: Knobs, rng: random.Random) -> None:
    k.precision = rng.choice(["bf16-mixed", "16-mixed"])


CAPABILITIES: dict[str, Capability] = {
    "pipeline": Capability(_set(stages=2), lambda k: k.pipelined),
    "tensor parallel": Capability(_set(tensor=2), lambda k: k.tensor > 1),
    "sharded reduction": Capability(_set(reduction="sharded", replicas=2), lambda k: k.reduction == "sharded"),
    "deterministic": Capability(lambda k, rng: None, lambda k: True),  # every draw
    "heterogeneous speeds": Capability(_set(balance=True, replicas=2), lambda k: k.balance),
    "autoscaler": Capability(_autoscale, lambda k: k.autoscale is not None),
    "resize": Capability(_resize, lambda k: "resize" in k.changes),
    "failure recovery": Capability(_failure, lambda k: "lost" in k.changes),
    "Bamboo": Capability(_set(redundancy=True, stages=2), lambda k: k.redundancy),
    "tied weights": Capability(_set(tied=True, stages=2), lambda k: k.tied),
    "breakdown": Capability(_set(breakdown=True), lambda k: k.breakdown),
    "overlapped input": Capability(_set(loader_workers=2), lambda k: k.loader_workers > 0),
    "mixed precision": Capability(_precision, lambda k: k.precision != "32"),
    "clipping": Capability(_set(max_grad_norm=0.05), lambda k: k.max_grad_norm is not None),
    "sharded parameters": Capability(_set(reduction="fsdp", replicas=2), lambda k: k.reduction == "fsdp"),
}


def knobs_of(caps: frozenset[str], rng: random.Random) -> Knobs:
    k = Knobs()
    for name in sorted(caps):
        CAPABILITIES[name].on_knobs(k, rng)
    if "lost" in k.changes and k.redundancy:  # Bamboo fails over: the last change (no resize of a shorter replica)
        k.changes.append(k.changes.pop(k.changes.index("lost")))
    elif "lost" in k.changes:
        k.replicas = 2
        # an unpipelined sharded run keeps a replica of every chunk (a pipeline's stages cannot)
        k.shard_replicas = int(k.reduction == "sharded" and not k.pipelined)
    return k


# ---- the facts the table's conditions read ------------------------------------------------------
def facts(k: Knobs) -> dict[str, Any]:
    """Every fact a refusal row's condition or message reads, for this draw."""
    out: dict[str, Any] = dict(
        pipelined=k.pipelined, loader_workers=k.loader_workers, autoscale=k.autoscale, per_replica=k.replica_workers,
        uneven_vn_sizes=False, balanced=k.balance, tensor=k.tensor, flush=True, schedule="1f1b", chunks=1,
        stages=k.stages, streaming=False, precision=k.precision, compile=False, checkpoint_format="pt",
        batchnorm=False, max_grad_norm=k.max_grad_norm, activation_checkpointing=None, redundancy=k.redundancy,
        flush_schedules=("1f1b", "gpipe", "interleaved_1f1b", "zb_h1"), tensor_chunks=1, tied=False,
        deterministic=True, uses=0, exact_uses=2, names="", shard_replicas=k.shard_replicas, reduction=k.reduction,
        j=0, first="", i=0, name="",
        # a batch schedule is not a knob of the sweep (tests/unit/test_batch_schedule.py): its rows never apply
        batch_schedule=False, pipeline=k.pipelined, workers=1, fewest=1, step=0,
    )
    if k.pipelined:
        layers = layers_of(_model(k.tied))
        groups = tied_parameters(layers, resolve_bounds(vf.Pipeline(stages=k.stages), len(layers)), k.stages)
        if groups:
            (j, first), (i, name) = groups[0][0], groups[0][1]
            out.update(tied=True, j=j, first=first, i=i, name=name, uses=len(groups[0]))
    return out


def expected_refusals(k: Knobs, job_facts: dict[str, Any]) -> list[table.Refusal]:
    """The table's rows that refuse this draw: both capabilities in effect (a row about a knob the
    sweep leaves alone is decided by its condition over the facts) and the condition true."""
    def present(name: str) -> bool:
        return CAPABILITIES[name].present(k) if name in CAPABILITIES else True

    return [r for r in table.REFUSALS if present(r.a) and present(r.b) and r.when(**job_facts)]


def tolerance(precision: str) -> tuple[float, float]:
    key = ("tensor parallel", precision)
    assert key in table.TOLERANCES, (f"the table states no tolerance for {key} (config/composition.py "
                                     f"TOLERANCES), and tensor parallelism with it is not refused")
    return table.TOLERANCES[key]


# ---- the generations of a draw ------------------------------------------------------------------
def generations(k: Knobs) -> list[Generation]:
    """The draw's generations: ``k.replicas`` replicas, then each change (a loss: the member held
    last dies inside a step, and the next generation is what the membership controller decides:
    without its replica, or with Bamboo that replica failed over, one worker shorter; a resize: one
    replica more or less, newcomers on fresh worker ids); the 3 steps spread over them, every change
    after a step."""
    r = k.replica_workers
    replicas = [list(range(j * r, (j + 1) * r)) for j in range(k.replicas)]
    fresh = k.replicas * r
    steps = [1] * len(k.changes) + [STEPS - len(k.changes)] if len(k.changes) < STEPS else [1, 1] + [0] * (
        len(k.changes) - 2) + [1]
    out, layout = [], None
    for n, change in enumerate(k.changes + [None]):
        members = tuple(w for rep in replicas for w in rep) if layout is None else members
        lost = members[-1] if change == "lost" else None
        out.append(Generation(members=members, steps=steps[n], lost=lost, layout=layout,
                              assignment=_map(k, len(replicas)) if layout is None else None))
        if change == "lost" and k.redundancy:
            tensor = {"tensor": k.tensor} if k.tensor > 1 else {}  # (judged by tensor groups)
            decision = decide_failover(stages=k.replica_workers, members=members, layout=None, formed=None,
                                       dead={lost}, replace_failed=False, **tensor)
            members, layout = decision.members, decision.layout
        elif change == "lost" or (change == "resize" and len(replicas) == 2):
            replicas = replicas[:1]
        elif change == "resize":
            replicas.append(list(range(fresh, fresh + r)))
            fresh += r
    return out


def _map(k: Knobs, replicas: int) -> list[list[int]] | None:
    """Heterogeneous speeds: the uneven map a speed-based rebalance publishes (3 VNs and 1), every
    member of a replica holding its replica's block."""
    if not k.balance or replicas == 1:
        return None
    return [[0, 1, 2]] * k.replica_workers + [[3]] * k.replica_workers


# ---- a draw ------------------------------------------------------------------------------------
_REFERENCES: dict[tuple, Any] = {}


def reference(k: Knobs) -> Any:
    """The single-worker unpipelined run of the draw's job (no loaders, no breakdown)."""
    key = (k.precision, k.max_grad_norm, k.tied)
    if key not in _REFERENCES:
        plain = Knobs(precision=k.precision, max_grad_norm=k.max_grad_norm, tied=k.tied)
        _REFERENCES[key] = train_threads(job_of(plain), [Generation(members=(0,), steps=STEPS)],
                                         options=WorkerOptions(deterministic=True, breakdown=False))
    return _REFERENCES[key]


def launch(k: Knobs, job: vf.Job, run_dir: str) -> vf.Job:
    """What ``vf.train`` checks before any worker starts (raises the refusal); returns the job as
    the launch resolved it."""
    opts = vf.LaunchOptions(workers=k.replicas * k.replica_workers, steps=STEPS, deterministic=True,
                            reduction=k.reduction, shard_replicas=k.shard_replicas, loader_workers=k.loader_workers,
                            breakdown=k.breakdown, balance=k.balance, autoscale=k.autoscale,
                            max_workers=2 * k.replica_workers if k.autoscale else None, run_dir=run_dir)
    with prepare(job, opts) as setup:
        setup.run_lock.release()
        return setup.job


def run_draw(caps: frozenset[str], rng: random.Random, run_dir: str, label: str) -> str:
    """Train one draw and check it; returns what happened (``works``, ``refused: <row>`` or
    ``stops: ShardLost``)."""
    k = knobs_of(caps, rng)
    f = facts(k)
    missing = {p for r in table.REFUSALS for p in inspect.signature(r.when).parameters if p != "_"} - set(f)
    assert not missing, f"{label}: refusal rows read facts the sweep does not give: {sorted(missing)}; add them to facts()"
    rows = expected_refusals(k, f)
    said = {r.says(**f): r.key for r in rows}
    where = f"{label}: {sorted(caps)} -> {k}"
    try:
        job = launch(k, job_of(k), run_dir)  # (the Pipeline's own rows refuse when it is made)
        run = train_threads(job, generations(k), options=WorkerOptions(
            deterministic=True, reduction=k.reduction, shard_replicas=k.shard_replicas,
            loader_workers=k.loader_workers, breakdown=k.breakdown), timeout_s=30.0)
    except ValueError as exc:
        assert str(exc) in said, f"{where}: refused with a message no row of the table gives for it: {exc}" + (
            f"; the table's: {list(said)}" if said else "")
        return f"refused: {said[str(exc)]}"
    except ShardLost:
        # (one copy of each chunk or shard: in processes the run falls back to its checkpoint,
        # tests/e2e/test_fsdp_e2e.py; a threaded run has none)
        assert k.reduction in ("sharded", "fsdp") and "lost" in k.changes and not k.shard_replicas, where
        return "stops: ShardLost"
    assert not rows, f"{where}: trained, but the table refuses it: {[r.key for r in rows]}"
    check_against_reference(run, reference(k), k, where)
    return "works"


def check_against_reference(run: Any, ref: Any, k: Knobs, where: str) -> None:
    got, want = run.state["model"], ref.state["model"]
    losses = [o.loss for o in run.outcomes]
    norms = [o.grad_norm for o in run.outcomes]
    assert len(losses) == STEPS, where
    if k.tensor == 1:  # the table's promise without tensor parallelism: the same bits
        assert_state_equal(got, want)
        assert losses == [o.loss for o in ref.outcomes], where
        if k.max_grad_norm is not None:  # (without clipping, 16-mixed's VN engine reports a norm, a stage None)
            assert norms == [o.grad_norm for o in ref.outcomes], where
    else:
        atol, rtol = tolerance(k.precision)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=atol, rtol=rtol, msg=lambda m: f"{where}: {m}")
        assert losses == pytest.approx([o.loss for o in ref.outcomes], rel=rtol, abs=atol), where
    if k.max_grad_norm is not None and k.precision != "16-mixed":
        assert min(norms) > k.max_grad_norm, f"{where}: the clip never acted"
    for o in run.outcomes:  # the breakdown of every reported worker adds up to its step
        for row in o.breakdown or []:
            if row is not None:
                assert sum(row[p] for p in parts.PARTS) == pytest.approx(row["step_s"], rel=1e-5, abs=1e-6), where


# ---- the draws ---------------------------------------------------------------------------------
NAMES = [name for name, _ in table.CAPABILITIES]

HEAVIEST: list[frozenset[str]] = [frozenset(c) for c in (
    NAMES,  # everything at once
    ("pipeline", "tensor parallel", "sharded reduction", "resize", "failure recovery"),
    ("tensor parallel", "resize", "failure recovery", "breakdown", "clipping"),
    ("pipeline", "tensor parallel", "tied weights", "heterogeneous speeds", "clipping"),
    ("pipeline", "Bamboo", "heterogeneous speeds", "mixed precision", "clipping"),
    ("pipeline", "tied weights", "resize", "failure recovery", "breakdown"),
    ("sharded reduction", "heterogeneous speeds", "overlapped input", "mixed precision", "failure recovery"),
    ("tensor parallel", "mixed precision", "sharded reduction", "clipping"),
    ("pipeline", "overlapped input", "autoscaler", "resize"),
    ("tensor parallel", "Bamboo", "failure recovery"),
)]


def draws() -> list[frozenset[str]]:
    rng = random.Random(SEED)
    return [frozenset(rng.sample(NAMES, rng.randint(3, 5))) for _ in range(DRAWS)]


def test_every_capability_of_the_table_has_its_knobs_in_the_sweep():
    assert set(CAPABILITIES) == set(NAMES), (f"capabilities of the table without a row here: "
                                             f"{sorted(set(NAMES) - set(CAPABILITIES))}")


def test_random_and_heaviest_combinations_train_the_single_worker_model_or_are_refused_by_the_table(tmp_path):
    t0 = time.perf_counter()
    seen: dict[str, int] = {}
    for n, caps in enumerate(HEAVIEST + draws()):
        label = f"draw {n} (seed {SEED})" if n >= len(HEAVIEST) else f"heavy {n}"
        t1 = time.perf_counter()
        outcome = run_draw(caps, random.Random(f"{SEED}/{n}"), str(tmp_path / f"run{n}"), label)
        print(f"{label}: {sorted(caps)}: {outcome} ({time.perf_counter() - t1:.2f} s)")
        seen[outcome.split(":")[0]] = seen.get(outcome.split(":")[0], 0) + 1
    print(f"composition sweep, seed {SEED}: {seen} in {time.perf_counter() - t0:.1f} s")
    assert seen.get("works", 0) >= len(HEAVIEST) // 3, f"seed {SEED}: too few draws train at all: {seen}"
