"""Deprecated: moved to :mod:`virtualflow.launching.resume`; this alias will be removed.

The old path is the new module itself (``sys.modules`` holds one object under both names), so
every name, private ones included, and every ``monkeypatch`` through the old path reach the code
that runs.
"""

import sys as _sys
import warnings as _w

from virtualflow.launching import resume as _moved

_w.warn("virtualflow.resume is deprecated; import virtualflow.launching.resume", DeprecationWarning, stacklevel=2)
_sys.modules[__name__] = _moved
