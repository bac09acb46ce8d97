"""THE table of the pairs of capabilities (and knobs) that cannot be combined, each with its reason.

Purpose: every refusal of a combination is one row of :data:`REFUSALS`: the two capabilities, the
condition over the facts the checking site knows (keyword arguments: plain values such as
``tensor=2``, ``schedule="2bw"``), and the one-line message, which names the value, the rule and
the knob to change. A site refuses by naming its rows: ``check("redundancy+flush", redundancy=...,
stages=...)`` raises the first row's ``ValueError`` whose condition holds, in the order
named. The launch applies the rows that need the options (:mod:`virtualflow.launching.composition`),
the :class:`~virtualflow.config.pipeline.Pipeline` those about its own fields, and the worker's
engines those that need the built model (their ``site``). docs/composition.md's pairs are
generated from this table and the tests of the working pairs (``scripts/gen_composition.py``).

Invariants: pure (no torch, nothing built, nothing imported from above ``config/``); each row's
``example`` facts satisfy its condition, so the documentation quotes the message the code raises;
a capability is named as in docs/composition.md's list (:data:`CAPABILITIES`), a knob that is
not one of them by its own name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["CAPABILITIES", "REFUSALS", "Refusal", "TOLERANCES", "check", "check_stage_sharding", "refusal"]

CAPABILITIES: tuple[tuple[str, str], ...] = (
    ("pipeline", "`Job.pipeline = vf.Pipeline(stages=P)`, `--pipeline-stages` ([pipeline.md](pipeline.md))"),
    ("tensor parallel", "`Pipeline(tensor=T)`, `--tensor-parallel` ([parallel3d.md](parallel3d.md))"),
    ("sharded reduction", "`reduction=\"sharded\"`, `--reduction sharded` ([coconet.md](coconet.md#sharded-data-parallel))"),
    ("deterministic", "`deterministic=True`, `--deterministic` "
                      "([training.md](training.md#deterministic-mode-what-it-costs-and-what-keeps-the-bits))"),
    ("heterogeneous speeds", "`--balance`, `--slowdowns`, worker specs ([heterogeneity.md](heterogeneity.md))"),
    ("autoscaler", "`--autoscale POLICY` ([autoscaling.md](autoscaling.md))"),
    ("resize", "`virtualflow resize`, `handle.resize(n)` ([elasticity.md](elasticity.md))"),
    ("failure recovery", "a lost worker, `--replace-failed` ([elasticity.md](elasticity.md))"),
    ("Bamboo", "`Pipeline(redundancy=True)` ([bamboo.md](bamboo.md))"),
    ("tied weights", "one weight read by layers on different pipeline stages (a tied embedding and head)"),
    ("breakdown", "`breakdown` (on by default; [observability.md](observability.md))"),
    ("overlapped input", "`--loader-workers N` "
                         "([observability.md](observability.md#overlapped-input---loader-workers-n))"),
    ("mixed precision", "`precision=\"bf16-mixed\"` or `\"16-mixed\"`, `--precision` "
                        "([training.md](training.md#the-training-loop))"),
    ("clipping", "`max_grad_norm`, `--max-grad-norm` ([training.md](training.md#the-training-loop))"),
    ("sharded parameters", "`reduction=\"fsdp\"`, `--reduction fsdp` "
                           "([training.md](training.md#sharded-parameters-reductionfsdp), [memory.md](memory.md))"),
)
"""The capabilities docs/composition.md crosses pairwise: (name, the knob)."""

_FLUSH = "(1f1b, gpipe, interleaved_1f1b, zb_h1)"


@dataclass(frozen=True)
class Refusal:
    """One combination that is refused, and why."""

    key: str
    """The row's name, what a checking site passes to :func:`check`."""
    a: str
    """The first capability (or knob) of the pair."""
    b: str
    """The second."""
    when: Callable[..., bool]
    """The condition over the site's facts (keyword arguments): True refuses."""
    says: Callable[..., str]
    """The one-line message from the same facts: the value, the rule and the knob to change."""
    example: Mapping[str, Any]
    """Facts for which ``when`` holds: the documentation quotes ``says(**example)``."""
    site: str
    """Where the row is checked (the function that calls :func:`check` with it)."""

    def message(self) -> str:
        """The message of :attr:`example`, as the documentation quotes it."""
        return self.says(**self.example)


def _row(key: str, a: str, b: str, when: Callable[..., bool], says: Callable[..., str],
         example: Mapping[str, Any], site: str) -> Refusal:
    return Refusal(key, a, b, when, says, dict(example), site)


def _tensor_says(what: str, why: str) -> Callable[..., str]:
    return lambda tensor, **_: f"{what} with Pipeline.tensor={tensor} (--tensor-parallel): {why}"


def _no_flush_loop_says(schedule: str, precision: str, max_grad_norm: Any, activation_checkpointing: Any,
                        **_: Any) -> str:
    if precision == "16-mixed" or max_grad_norm is not None:
        knob = "precision='16-mixed'" if precision == "16-mixed" else f"max_grad_norm={max_grad_norm}"
        why = (f"{knob} needs the whole step's gradient before any update, and the {schedule} schedule "
               f"updates each stage as soon as its own backward is done (no flush)")
    else:
        why = (f"activation_checkpointing={activation_checkpointing!r} recomputes a micro-batch's forward in its "
               f"backward with the stage's current weights, and the {schedule} schedule runs forwards on "
               f"older weight versions")
    return (f"{why}; use a flush schedule (Pipeline.schedule='1f1b', 'gpipe', 'interleaved_1f1b' or "
            f"'zb_h1'), or drop the knob (bf16-mixed precision and compile work with every schedule)")


REFUSALS: tuple[Refusal, ...] = (
    # ---- at launch, from the options (virtualflow.launching.composition) ------------------------
    _row("pipeline+uneven_vn_sizes", "pipeline", "uneven VN sizes",
         when=lambda uneven_vn_sizes, **_: bool(uneven_vn_sizes),
         says=lambda **_: (
             "uneven_vn_sizes=True (--uneven-vn-sizes) gives faster workers bigger VNs, but every worker of "
             "a pipeline replica runs the same micro-batches; drop it: balance=True still weighs the "
             "replicas' micro-batch shares by speed"),
         example=dict(uneven_vn_sizes=True), site="launching.composition.check_pipeline_balance"),
    _row("balance+no_flush", "heterogeneous speeds", "no-flush schedule",
         when=lambda balanced, flush, **_: balanced and not flush,
         says=lambda schedule, **_: (
             f"balance (--balance, worker specs or slowdowns) weighs pipeline replicas' micro-batch shares "
             f"at step boundaries, but Pipeline.schedule={schedule!r} streams a window of steps "
             f"without one; use a flush schedule (1f1b, gpipe, zb_h1) or LaunchOptions.balance=False"),
         example=dict(balanced=True, flush=False, schedule="2bw"), site="launching.composition.check_pipeline_balance"),
    _row("balance+interleaved_chunks", "heterogeneous speeds", "interleaved chunks",
         when=lambda balanced, schedule, chunks, **_: balanced and schedule == "interleaved_1f1b" and chunks > 1,
         says=lambda chunks, stages, **_: (
             f"balance (--balance, worker specs or slowdowns) gives replicas unequal micro-batch counts, "
             f"but interleaved_1f1b with chunks={chunks} needs each replica's count to be a "
             f"multiple of stages={stages}; use chunks=1 (--chunks 1), the 1f1b schedule, or "
             f"LaunchOptions.balance=False"),
         example=dict(balanced=True, schedule="interleaved_1f1b", chunks=2, stages=2),
         site="launching.composition.check_pipeline_balance"),
    _row("uneven_vn_sizes+streaming", "uneven VN sizes", "streaming dataset",
         when=lambda streaming, uneven_vn_sizes, **_: streaming and bool(uneven_vn_sizes),
         says=lambda **_: (
             "uneven_vn_sizes=True gives faster workers bigger virtual nodes, but a streaming dataset splits "
             "each epoch's stream into virtual_nodes equal parts (docs/training.md, \"Streaming datasets\"): "
             "drop uneven_vn_sizes (--uneven-vn-sizes); balance=True still maps VNs by speed"),
         example=dict(streaming=True, uneven_vn_sizes=True), site="launching.composition.check_streaming"),
    # ---- at launch, from the job and its model (virtualflow.launching.pipeline) -------------------
    _row("no_flush+batchnorm", "no-flush schedule", "BatchNorm",
         when=lambda flush, batchnorm, **_: not flush and batchnorm,
         says=lambda schedule, **_: (
             f"Pipeline.schedule={schedule!r} streams steps without a flush, which cannot keep BatchNorm's "
             f"per-step statistics exact; use a flush schedule {_FLUSH}"),
         example=dict(flush=False, batchnorm=True, schedule="2bw"), site="launching.pipeline.plan_pipeline"),
    _row("no_flush+loop", "no-flush schedule", "mixed precision",
         when=lambda flush, precision, max_grad_norm, activation_checkpointing, **_: not flush and (
             precision == "16-mixed" or max_grad_norm is not None or activation_checkpointing is not None),
         says=_no_flush_loop_says,
         example=dict(flush=False, schedule="2bw", precision="16-mixed", max_grad_norm=None,
                      activation_checkpointing=None),
         site="runtime.pipeline.loop.check_schedule (and at launch: launching.pipeline)"),
    # ---- the Pipeline's own fields (virtualflow.config.pipeline.Pipeline) ----------------------
    _row("chunks+schedule", "interleaved chunks", "schedule",
         when=lambda chunks, schedule, **_: chunks > 1 and schedule != "interleaved_1f1b",
         says=lambda chunks, schedule, **_: (
             f"Pipeline.chunks={chunks} needs schedule='interleaved_1f1b' (got {schedule!r}); "
             f"use chunks=1 or the interleaved schedule"),
         example=dict(chunks=2, schedule="1f1b"), site="config.pipeline.Pipeline"),
    _row("redundancy+flush", "Bamboo", "no-flush schedule",
         when=lambda redundancy, stages, flush, **_: bool(redundancy) and (stages < 2 or not flush),
         says=lambda stages, schedule, flush_schedules, **_: (
             f"Pipeline.redundancy=True keeps a replica of each worker's successor stage, refreshed at every "
             f"step's flush: it needs stages >= 2 (got {stages}) and a flush schedule "
             f"{flush_schedules} (got {schedule!r})"),
         example=dict(redundancy=True, stages=2, flush=False, schedule="2bw",
                      flush_schedules=("1f1b", "gpipe", "interleaved_1f1b", "zb_h1")),
         site="config.pipeline.Pipeline"),
    _row("tensor_chunks+tensor", "tensor chunks", "tensor parallel",
         when=lambda tensor_chunks, tensor, **_: tensor_chunks > 1 and tensor == 1,
         says=lambda tensor_chunks, **_: (
             f"Pipeline.tensor_chunks={tensor_chunks} overlaps tensor-parallel collectives; it "
             f"needs tensor > 1 (got tensor=1): drop tensor_chunks or set tensor"),
         example=dict(tensor_chunks=2, tensor=1), site="config.pipeline.Pipeline"),
    # ---- a weight shared by layers of different pieces (launching.composition.check_shared_parameters)
    _row("tied_across_workers+no_flush", "tied weights", "no-flush schedule",
         when=lambda tied, flush, **_: bool(tied) and not flush,
         says=lambda j, first, i, name, schedule, **_: (
             f"parameter {j}.{first} is also layer {i}'s {name}, on another pipeline worker: the "
             f"{schedule} schedule cannot keep the copies of a shared weight exact; untie it (e.g. "
             f"GPT2Config(tie_word_embeddings=False)), cut the model so both layers are on one worker "
             f"(Pipeline.split), or use a flush schedule (Pipeline.schedule='1f1b', 'gpipe', 'interleaved_1f1b' "
             f"or 'zb_h1')"),
         example=dict(tied=True, flush=False, schedule="2bw", j=0, first="weight", i=3, name="weight"),
         site="launching.composition.check_shared_parameters"),
    _row("deterministic+tied_uses", "deterministic", "tied weights",
         when=lambda deterministic, uses, exact_uses, **_: deterministic and uses > exact_uses,
         says=lambda uses, names, exact_uses, **_: (
             f"one weight is read by {uses} layers in different pipeline pieces ({names}): "
             f"deterministic mode keeps a shared weight bit-identical to the unpipelined job only when "
             f"it is read by {exact_uses} layers (the order in which autograd adds three or more "
             f"gradients is not fixed); untie it, cut the model so all these layers are in one piece "
             f"(Pipeline.split), or train with deterministic=False (without --deterministic)"),
         example=dict(deterministic=True, uses=3, exact_uses=2, names="0.weight, 2.weight, 4.weight"),
         site="launching.composition.check_shared_parameters"),
    # ---- the sharded reduction (at launch, and again where a worker builds its engine) ----------
    _row("sharded+no_flush", "sharded reduction", "no-flush schedule",
         when=lambda flush, **_: not flush,
         says=lambda schedule, **_: (
             f"reduction='sharded' with Pipeline.schedule={schedule!r}: a no-flush schedule "
             f"keeps weight versions per stage that a sharded update does not; use a flush schedule "
             f"{_FLUSH} or reduction='allreduce' (--reduction)"),
         example=dict(flush=False, schedule="2bw"), site="config.composition.check_stage_sharding"),
    _row("shard_replicas+pipeline", "shard replicas", "pipeline",
         when=lambda shard_replicas, **_: bool(shard_replicas),
         says=lambda shard_replicas, **_: (
             f"shard_replicas={shard_replicas} keeps a replica of each sharded optimizer chunk on the next "
             f"worker of one data-parallel ring, which a pipeline does not have; a pipelined job keeps a replica "
             f"of each stage's chunk on the predecessor stage with Pipeline(redundancy=True) (Bamboo); "
             f"drop --shard-replicas"),
         example=dict(shard_replicas=1), site="config.composition.check_stage_sharding"),
    _row("shard_replicas+allreduce", "shard replicas", "all-reduce",
         when=lambda shard_replicas, reduction, **_: bool(shard_replicas) and reduction != "sharded",
         says=lambda shard_replicas, reduction, **_: (
             f"shard_replicas={shard_replicas} keeps replicas of the sharded optimizer's chunks; with "
             f"reduction={reduction!r} every worker holds the whole state already: drop "
             f"--shard-replicas or add --reduction sharded"),
         example=dict(shard_replicas=1, reduction="allreduce"), site="runtime.step.update.make_update"),
    # ---- sharded parameters (at launch: launching.composition.check_fsdp_layout, the options) ----
    _row("fsdp+bamboo", "Bamboo", "sharded parameters",
         when=lambda reduction, redundancy, **_: reduction == "fsdp" and bool(redundancy),
         says=lambda **_: (
             "reduction='fsdp' with Pipeline(redundancy=True): Bamboo keeps each stage's successor whole on its "
             "predecessor, and sharded parameters are not cut inside a pipeline's stages yet; use "
             "reduction='sharded' (each stage's optimizer state sharded, failed over by Bamboo) or drop the "
             "pipeline (--reduction, Job.pipeline)"),
         example=dict(reduction="fsdp", redundancy=True), site="launching.composition.check_fsdp_layout"),
    _row("fsdp+tensor", "tensor parallel", "sharded parameters",
         when=lambda reduction, tensor, **_: reduction == "fsdp" and tensor > 1,
         says=lambda tensor, **_: (
             f"reduction='fsdp' with Pipeline.tensor={tensor} (--tensor-parallel): sharded parameters are not cut "
             f"over the replicas of a tensor-parallel stage yet (HSDP); drop --tensor-parallel (fsdp alone divides "
             f"every unit by the workers) or use reduction='sharded'"),
         example=dict(reduction="fsdp", tensor=2), site="launching.composition.check_fsdp_layout"),
    _row("fsdp+pipeline", "pipeline", "sharded parameters",
         when=lambda reduction, stages, **_: reduction == "fsdp" and stages > 1,
         says=lambda stages, **_: (
             f"reduction='fsdp' with Pipeline.stages={stages} (--pipeline-stages): sharded parameters are gathered "
             f"unit by unit by the virtual-node engine, which a pipeline stage does not run yet; drop the pipeline "
             f"(fsdp alone divides the model's memory by the workers) or use reduction='sharded' (each stage's "
             f"optimizer state sharded over its replicas)"),
         example=dict(reduction="fsdp", stages=2), site="launching.composition.check_fsdp_layout"),
    _row("fsdp+shard_replicas", "sharded parameters", "shard replicas",
         when=lambda reduction, shard_replicas, **_: reduction == "fsdp" and bool(shard_replicas),
         says=lambda shard_replicas, **_: (
             f"shard_replicas={shard_replicas} with reduction='fsdp': parameter shards have no replica yet, so a "
             f"failed worker's shard is restored from the last checkpoint (--checkpoint-every, --resume); drop "
             f"--shard-replicas (it keeps replicas of the optimizer chunks of reduction='sharded')"),
         example=dict(reduction="fsdp", shard_replicas=1), site="config.options.LaunchOptions"),
    # ---- a batch schedule (Job.batch_schedule; at launch: launching.composition.check_batch_schedule) ----
    _row("batch_schedule+pipeline", "batch schedule", "pipeline",
         when=lambda batch_schedule, pipeline, **_: bool(batch_schedule) and bool(pipeline),
         says=lambda **_: (
             "Job.batch_schedule with Job.pipeline: a pipeline's micro-batch plan and stage engines are built for "
             "one V, and changing it in place is not implemented; drop the pipeline or the batch schedule"),
         example=dict(batch_schedule=True, pipeline=True), site="launching.composition.check_batch_schedule"),
    _row("batch_schedule+sharded", "batch schedule", "sharded reduction",
         when=lambda batch_schedule, reduction, **_: bool(batch_schedule) and reduction in ("sharded", "fsdp"),
         says=lambda reduction, **_: (
             f"Job.batch_schedule with reduction={reduction!r}: a change of V in place is implemented for the "
             f"all-reduce only (every worker holds the whole state); use reduction='allreduce' (--reduction) "
             f"or drop the batch schedule"),
         example=dict(batch_schedule=True, reduction="sharded"), site="launching.composition.check_batch_schedule"),
    _row("batch_schedule+balance", "batch schedule", "heterogeneous speeds",
         when=lambda batch_schedule, balanced, **_: bool(batch_schedule) and bool(balanced),
         says=lambda **_: (
             "Job.batch_schedule with balance (speed-weighted VN maps or uneven VN sizes): a change of V maps the "
             "new V evenly over the workers; drop --balance / --uneven-vn-sizes or the batch schedule"),
         example=dict(batch_schedule=True, balanced=True), site="launching.composition.check_batch_schedule"),
    _row("batch_schedule+streaming", "batch schedule", "streaming dataset",
         when=lambda batch_schedule, streaming, **_: bool(batch_schedule) and bool(streaming),
         says=lambda **_: (
             "Job.batch_schedule with a streaming dataset: a stream's shards are split for one global batch; use "
             "a map-style dataset or drop the batch schedule"),
         example=dict(batch_schedule=True, streaming=True), site="launching.composition.check_batch_schedule"),
    _row("batch_schedule+workers", "batch schedule", "workers",
         when=lambda batch_schedule, workers, fewest, **_: bool(batch_schedule) and workers > fewest,
         says=lambda workers, fewest, step, **_: (
             f"Job.batch_schedule runs virtual_nodes={fewest} from step {step}, fewer than the {workers} workers the "
             f"run may have (--workers, --max-workers); every worker needs a virtual node: lower the workers or "
             f"raise that change's virtual_nodes"),
         example=dict(batch_schedule=True, workers=4, fewest=2, step=6),
         site="launching.composition.check_batch_schedule"),
    # ---- where a worker builds its stage (runtime.pipeline.engine.StageEngine) ------------------
    _row("tied+no_flush", "tied weights", "no-flush schedule",
         when=lambda tied, flush, **_: bool(tied) and not flush,
         says=lambda schedule, **_: (
             f"weights shared across pipeline workers need a flush schedule, not Pipeline.schedule="
             f"{schedule!r}; use '1f1b', 'gpipe', 'interleaved_1f1b' or 'zb_h1'"),
         example=dict(tied=True, flush=False, schedule="2bw"), site="runtime.pipeline.engine.StageEngine"),
    _row("no_flush+batchnorm_stage", "no-flush schedule", "BatchNorm",
         when=lambda flush, batchnorm, **_: not flush and batchnorm,
         says=lambda schedule, **_: (
             f"Pipeline.schedule={schedule!r} streams steps without a flush, which cannot keep "
             f"BatchNorm's per-step statistics exact; use a flush schedule (1f1b, gpipe, interleaved_1f1b, "
             f"zb_h1) for a model with BatchNorm"),
         example=dict(flush=False, batchnorm=True, schedule="2bw"), site="runtime.pipeline.engine.StageEngine"),
)
"""Every refused combination, one row each (see the module docstring)."""

TOLERANCES: dict[tuple[str, str], tuple[float, float]] = {
    ("tensor parallel", "32"): (1e-7, 1.3e-6),
    ("tensor parallel", "bf16-mixed"): (2e-3, 1.6e-2),
    ("tensor parallel", "16-mixed"): (3e-4, 1e-3),
}
"""How far a capability that changes the order of floating-point sums may move the model from
the single-worker run, per precision: ``(capability, precision) -> (atol, rtol)`` for
``torch.testing.assert_close`` on the weights after 3 steps of a small transformer in
deterministic mode (a pair without an entry is bit-identical).

Tensor parallelism cuts each row-parallel sum into T partial sums (float32 under mixed precision,
rounded once: :class:`virtualflow.parallel.collectives.Precision`). Measured on the grid GPT of
``tests/gpt_grid_jobs.py`` in float32 (4 layers, width 32, 4 heads, SGD lr 0.2 momentum 0.9,
global batch 16 in 4 VNs), ``(1, 1, 2)`` against the unpipelined single worker, 3 steps, max
absolute difference of the weights: 2.6e-8 (``"32"``), 4.1e-4 (``"bf16-mixed"``), 5.9e-5
(``"16-mixed"``); ``atol`` is about 4-5 times that, ``rtol`` torch's default for the
compute dtype. Command: ``python tests/unit/test_tp_precision.py`` (docs/parallel3d.md, "Mixed
precision and compile"). Layouts of the same T are bit-identical to each other."""

_BY_KEY: dict[str, Refusal] = {r.key: r for r in REFUSALS}


def refusal(key: str) -> Refusal:
    """The row named ``key`` (``KeyError`` naming the known rows otherwise)."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no refusal {key!r}; the table has {sorted(_BY_KEY)}") from None


def check(*keys: str, **facts: Any) -> None:
    """Raise the ``ValueError`` of the first row of ``keys`` (in that order) whose condition holds
    for ``facts``; return when none does."""
    for key in keys:
        row = refusal(key)
        if row.when(**facts):
            raise ValueError(row.says(**facts))


def check_stage_sharding(pipeline: Any, *, shard_replicas: int = 0) -> None:
    """The rows of the sharded reduction with a pipeline (``pipeline``: a
    :class:`~virtualflow.config.pipeline.Pipeline`): no-flush schedules, replicas of the chunks;
    checked at launch and where a worker builds its stage."""
    check("sharded+no_flush", "shard_replicas+pipeline", flush=pipeline.flush, schedule=pipeline.schedule,
          shard_replicas=shard_replicas)

