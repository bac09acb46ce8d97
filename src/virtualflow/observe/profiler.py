"""Deprecated: moved to :mod:`virtualflow.runtime.trace_window`; this alias will be removed.

The worker (``runtime/``) starts the trace, and ``observe/`` sits above ``runtime/``: the
window's tracer lives in the runtime layer now."""

import warnings as _w

from virtualflow.runtime.trace_window import *  # noqa: F401,F403
from virtualflow.runtime.trace_window import StepProfiler as StepProfiler  # noqa: F401
from virtualflow.runtime.trace_window import __all__ as __all__  # noqa: F401

_w.warn("virtualflow.observe.profiler is deprecated; import virtualflow.runtime.trace_window",
        DeprecationWarning, stacklevel=2)
