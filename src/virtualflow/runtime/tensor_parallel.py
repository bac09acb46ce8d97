"""Deprecated: moved to :mod:`virtualflow.parallel.tensor` (import the names from
:mod:`virtualflow.parallel`); this alias will be removed."""
import warnings as _w

from virtualflow.parallel import *  # noqa: F401,F403
from virtualflow.parallel import __all__ as __all__  # noqa: F401

_w.warn("virtualflow.runtime.tensor_parallel is deprecated; import virtualflow.parallel", DeprecationWarning,
        stacklevel=2)
