"""Deprecated: moved to :mod:`virtualflow.parallel.tracing` (also exported by
:mod:`virtualflow.parallel`); this alias will be removed."""
import warnings as _w

from virtualflow.parallel.tracing import *  # noqa: F401,F403
from virtualflow.parallel.tracing import __all__ as __all__  # noqa: F401

_w.warn("virtualflow.tracing is deprecated; import virtualflow.parallel.tracing", DeprecationWarning, stacklevel=2)
