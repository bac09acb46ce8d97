"""Deprecated: moved to :mod:`virtualflow.runtime.pipeline.local` (the in-process driver) and
:mod:`virtualflow.backends.inprocess` (building and training a pipelined job in this process,
with ``VIRTUALFLOW_EAGER_EVERY_WAIT`` read there); this alias will be removed.

(An alias only: it imports upward into ``backends/`` so that ``build_engine`` and ``train_local``
keep honouring the environment variable as before; the layering test must exempt it.)
"""
import warnings as _w

from virtualflow.backends.inprocess import build_engine, train_local  # noqa: F401
from virtualflow.runtime.pipeline.local import LocalDriver, PipelineDeadlock  # noqa: F401

__all__ = ["LocalDriver", "PipelineDeadlock", "build_engine", "train_local"]

_w.warn("virtualflow.runtime.pipeline_local is deprecated; import virtualflow.runtime.pipeline.local "
        "(LocalDriver) or virtualflow.backends.inprocess (build_engine, train_local)",
        DeprecationWarning, stacklevel=2)
