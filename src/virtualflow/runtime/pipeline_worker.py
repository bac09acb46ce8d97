"""Deprecated: moved to :mod:`virtualflow.runtime.pipeline.worker_engine` (the pipeline worker
engine; its process links are :mod:`virtualflow.runtime.pipeline.links`); this alias will be removed."""
import warnings as _w

from virtualflow.runtime.pipeline.links import Links, drive  # noqa: F401
from virtualflow.runtime.pipeline.worker_engine import PipelineWorkerEngine  # noqa: F401

__all__ = ["Links", "PipelineWorkerEngine", "drive"]

_w.warn("virtualflow.runtime.pipeline_worker is deprecated; import virtualflow.runtime.pipeline.worker_engine",
        DeprecationWarning, stacklevel=2)
