"""An elastic-batch job's submission: ``submit --batch-size-range B_MIN:B_MAX --lr-rule RULE``.

Purpose: the checks and the stored form of a cluster-service job that lets the scheduler change
its batch size (the ``elastic_batch`` policy, :mod:`virtualflow.cluster.policies.elastic_batch`),
pure: no database, no processes. A batch ``B`` runs as ``V = B / vn_size`` virtual nodes of the
job's own per-VN size (``Job.global_batch_size / Job.virtual_nodes``), and the learning rate is
multiplied by the rule's factor relative to the job's own batch.

Invariants: every refusal is one ``ValueError`` line naming the value, the rule and the option,
raised at submit (before anything is written); a stored cell (:func:`batch_cell`) has a range of
multiples of ``vn_size`` holding the job's batch, whose smallest batch has a virtual node for every
worker the job may run with at least (``--min-workers``, or ``--workers`` for a rigid job).
"""

from __future__ import annotations

import json
from typing import Any

from virtualflow.cluster.model import JobSpec

__all__ = ["batch_cell", "parse_range", "parse_rule"]


def parse_range(text: str) -> tuple[int, int]:
    """``"32:256"`` -> ``(32, 256)`` (``--batch-size-range``)."""
    lo, sep, hi = text.partition(":")
    try:
        return int(lo), int(hi)
    except ValueError:
        raise ValueError(f"--batch-size-range {text!r} must be B_MIN:B_MAX, two whole numbers of samples (e.g. "
                         f"32:256)") from None


def parse_rule(text: str) -> str | dict[int, float]:
    """``linear``, ``sqrt`` or a JSON ``{"batch": multiplier}`` object (``--lr-rule``)."""
    if text in ("linear", "sqrt"):
        return text
    try:
        rule = json.loads(text)
        if isinstance(rule, dict):
            return {int(b): m for b, m in rule.items()}
    except ValueError:
        pass
    raise ValueError(f"--lr-rule {text!r} must be linear, sqrt or a JSON object {{\"batch\": multiplier, ...}} "
                     f"naming every batch of --batch-size-range")


def batch_cell(batch_range: tuple[int, int] | None, lr_rule: Any, vn_size: int | None, *, global_batch_size: int,
               virtual_nodes: int, min_workers: int, max_workers: int, elastic: bool) -> dict[str, Any] | None:
    """The ``jobs.batch`` cell of a submission (None: the job keeps its batch), checked against
    the job's own batch (``global_batch_size`` over ``virtual_nodes``) and worker counts."""
    if batch_range is None:
        if lr_rule is not None or vn_size is not None:
            given = "--lr-rule" if lr_rule is not None else "--vn-size"
            raise ValueError(f"{given} is set but --batch-size-range is not; a job that keeps its batch has no "
                             f"learning-rate rule (give --batch-size-range B_MIN:B_MAX to opt in)")
        return None
    own = global_batch_size // virtual_nodes
    if vn_size is not None and vn_size != own:
        raise ValueError(f"--vn-size {vn_size} is not the job's samples per virtual node (global_batch_size="
                         f"{global_batch_size} / virtual_nodes={virtual_nodes} = {own}); leave --vn-size out or "
                         f"give {own}")
    try:
        spec = JobSpec(job_id=0, job_type="submit", scale_factor=max_workers, min_gpus=min_workers if elastic else None,
                       total_steps=1.0, batch_size=global_batch_size, vn_size=own, batch_size_range=batch_range,
                       lr_rule=lr_rule)
    except ValueError as exc:  # JobSpec's line, the job's batch named as the job names it
        raise ValueError("--batch-size-range/--lr-rule: " + str(exc).removeprefix("job 0: ").replace(
            "batch_size=", "the job's global_batch_size=")) from None
    lo, hi = batch_range
    if lo // own < min_workers:
        raise ValueError(f"--batch-size-range {lo}:{hi}: B_MIN={lo} is {lo // own} virtual nodes of {own} samples, "
                         f"fewer than the {min_workers} workers the job runs with at least; every worker needs a "
                         f"virtual node: raise B_MIN to {min_workers * own}")
    rule = spec.lr_rule if isinstance(spec.lr_rule, str) else {str(b): float(m) for b, m in spec.lr_rule.items()}
    return {"base": global_batch_size, "vn_size": own, "range": [lo, hi], "lr_rule": rule, "now": global_batch_size,
            "fewest": virtual_nodes}
