"""Which launch options a pipelined job cannot combine with, refused before any worker starts.

Purpose: the pairs of capabilities that docs/composition.md lists as "refused at launch" and that
no single component owns (the pipeline's own refusals live with it: ``Pipeline``'s fields,
:mod:`virtualflow.launching.pipeline`). Each refusal is one ``ValueError`` line that names the
value, the rule and the knob to change.

Invariant: nothing here builds the model or starts anything; :func:`check_pipeline_options`
reads only the resolved ``Pipeline`` and the options, so it runs before the profile.
"""

from __future__ import annotations

from typing import Any

from virtualflow.config.options import LaunchOptions

__all__ = ["check_pipeline_options"]


def check_pipeline_options(pipeline: Any, opts: LaunchOptions, policy: Any = None) -> None:
    """Refuse the launch options a pipelined job (``pipeline``, a resolved
    :class:`~virtualflow.config.pipeline.Pipeline`) cannot honour; ``policy`` is the autoscaler's
    policy (None without ``autoscale``)."""
    if pipeline is None:
        return
    per_replica = pipeline.stages * pipeline.tensor
    if opts.loader_workers:
        raise ValueError(f"loader_workers={opts.loader_workers} (--loader-workers) with a pipelined job "
                         f"(Job.pipeline, --pipeline-stages or --tensor-parallel): a pipeline's first stage loads "
                         f"each micro-batch when its forward runs and has no loader threads; drop --loader-workers")
    if opts.autoscale is not None:
        name = getattr(policy, "name", opts.autoscale)
        raise ValueError(f"autoscale={name!r} (--autoscale) with a pipelined job ({per_replica} workers per "
                         f"replica): the autoscaler's policies add, remove and replace single workers, but a "
                         f"pipeline grows and shrinks in whole replicas; drop --autoscale and resize in whole "
                         f"replicas (virtualflow resize, JobHandle.resize)")
