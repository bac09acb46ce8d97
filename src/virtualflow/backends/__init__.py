"""Backends: where worker processes run. One typed protocol, one place that chooses.

A backend is built from the job's :class:`~virtualflow.config.options.LaunchOptions` by
:func:`make_backend` (the only place that looks at ``options.backend``), asked where the
coordinator's store must listen (:meth:`Backend.store_address`), then attached to the running
coordinator (:meth:`Backend.attach`) and driven by the membership controller and the job handle
through the methods of :class:`Backend` only. The API never branches on a backend's name.

- ``local`` (:mod:`virtualflow.backends.local`): worker processes on this machine.
- ``ray`` (:mod:`virtualflow.backends.ray`): one Ray actor per worker on a Ray cluster.
- ``external`` (:mod:`virtualflow.backends.external`): workers started elsewhere join by address.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from virtualflow.backends.base import Attachment, Backend

if TYPE_CHECKING:
    from virtualflow.config.options import LaunchOptions

__all__ = ["Attachment", "Backend", "make_backend"]


def make_backend(options: LaunchOptions) -> Backend:
    """The backend ``options.backend`` names, configured from ``options``."""
    if options.backend == "ray":
        from virtualflow.backends.ray import RayBackend, RayOptions

        from virtualflow.config.network import parse_listen

        given = {k: getattr(options, k) for k in ("address", "cpus_per_worker", "gpus_per_worker", "resources",
                                                  "placement_timeout_s") if getattr(options, k) is not None}
        per_worker = {i: dict(s.resources) for i, s in enumerate(options.specs) if s.resources}
        listen = parse_listen(options.listen, "--listen", port_optional=True) if options.listen else None
        return RayBackend(RayOptions(**given, per_worker=per_worker, listen=listen))
    if options.backend == "external":
        from virtualflow.backends.external import ExternalBackend, parse_address

        return ExternalBackend(parse_address(options.listen), silence_s=options.heartbeat_timeout_s)
    from virtualflow.backends.local import LocalBackend

    return LocalBackend()
