"""Deprecated: split into :mod:`virtualflow.config.pipeline` (the ``Pipeline`` config, the split
parser and knob merger), :mod:`virtualflow.plan.pipeline.geometry` (how a model is cut, the
worker grid) and :mod:`virtualflow.launching.pipeline` (launch-time planning); this alias will be
removed."""

import warnings as _w
from typing import Any as _Any

from virtualflow.config.pipeline import (  # noqa: F401
    DEFAULT_SPLIT, FLUSH_SCHEDULES, SCHEDULE_NAMES, Pipeline, SplitSpec, merge_knobs, parse_split, pipeline_of,
)
from virtualflow.plan.pipeline.geometry import (  # noqa: F401
    Grid, bounds_from_counts, check_shared_parameters, check_split, check_workers, describe_split, layers_of,
    piece_module, resolve_bounds, split_bounds, successor_pieces, tensors_of, tied_for_worker, tied_parameters,
)

__all__ = [
    "DEFAULT_SPLIT", "FLUSH_SCHEDULES", "Grid", "Pipeline", "SCHEDULE_NAMES", "SplitSpec", "bounds_from_counts",
    "check_shared_parameters", "check_split", "check_workers", "describe_split", "layers_of", "merge_knobs",
    "parse_split", "piece_module", "pipeline_of", "plan_pipeline", "resolve_bounds", "split_bounds",
    "successor_pieces", "tensors_of", "tied_for_worker", "tied_parameters",
]

_w.warn("virtualflow.pipeline is deprecated; import virtualflow.config.pipeline (Pipeline), "
        "virtualflow.plan.pipeline.geometry (cutting) or virtualflow.launching.pipeline (plan_pipeline)",
        DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> _Any:
    # Launch-time planning imports the runtime: loaded on first use only, so that the runtime
    # modules still importing this old path do not import the launch layer.
    if name == "plan_pipeline":
        from virtualflow.launching.pipeline import plan_pipeline

        return plan_pipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
