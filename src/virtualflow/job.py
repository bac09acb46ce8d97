"""Deprecated: moved to :mod:`virtualflow.config.job`; this alias will be removed.

The old path is the new module itself (``sys.modules`` holds one object under both names), so
every name, private ones included, and every ``monkeypatch`` through the old path reach the code
that runs.
"""

import sys as _sys
import warnings as _w

from virtualflow.config import job as _moved

_w.warn("virtualflow.job is deprecated; import virtualflow.config.job", DeprecationWarning, stacklevel=2)
_sys.modules[__name__] = _moved
