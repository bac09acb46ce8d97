"""Setting up a cluster directory: ``cluster start``'s validation and the recorded configuration.

:func:`init_cluster` validates every knob first (nothing is written on error; each error names
the value, the rule and the flag), chooses the placement (:func:`virtualflow.backends.placement.
placement_of`: on Ray that includes connecting and checking the resources the slots claim), then
creates or reconfigures the database and writes a private dashboard token.

Invariants: the configuration written is exactly what the service reads back at every start
(:class:`virtualflow.service.runner.Service`); a directory's job ids are never reused (a database
made anew continues above the highest id handed out: a ``database_new`` event).
"""

from __future__ import annotations

import logging
import os

from virtualflow.backends.placement import placement_of
from virtualflow.cluster.policies.base import get_policy
from virtualflow.service.core import mechanism_knobs, type_slowdowns
from virtualflow.service.state import ClusterDB
from virtualflow.service.tables import gavel_table

log = logging.getLogger("virtualflow.service.runner")  # its lines keep the name they had before the split

__all__ = ["init_cluster"]


def init_cluster(cluster_dir: str, *, slots: dict[str, int], policy: str, round_s: float,
                 slowdowns: dict[str, float] | None = None, threads_per_worker: int = 1,
                 min_run_s: float = 0.0, dashboard_port: int | None = None, backend: str = "local",
                 address: str | None = None, cpus_per_worker: float = 1.0,
                 emulate_slowdowns: bool = False, mechanism: str = "default", launch_timeout_s: float = 60.0,
                 hang_factor: float = 10.0, hang_floor_s: float = 120.0,
                 hang_first_step_s: float = 600.0) -> ClusterDB:
    """Create (or reconfigure) a cluster directory: the database with the configuration, a
    private dashboard token. Validates everything first (nothing is written on error); with
    ``backend="ray"`` that includes connecting to the Ray cluster at ``address`` and checking that
    it has the resources the slots claim (:func:`check_ray_cluster`).

    The directory is private (:func:`~virtualflow.service.state.check_cluster_dir`): an existing
    one that is a symbolic link, another user's, or writable by others, or a database or token
    there that others may read or write, is refused naming the ``chmod`` that fixes it; what is
    created here is 0700 (directory) and 0600 (database, token). A database made anew in a
    directory whose earlier jobs it does not know (emptied, deleted) continues their ids above the
    highest handed out (``db.recreated_over``; a ``database_new`` event)."""
    if not slots:
        raise ValueError("--slots is empty; give accelerator types and counts, e.g. --slots v100=2,k80=2")
    get_policy(policy)  # raises for an unknown policy, naming the choices
    knobs = mechanism_knobs(mechanism)  # raises for an unknown name, naming the choices
    if not (round_s > 0 and round_s < 1e6):
        raise ValueError(f"--round-s {round_s} must be a positive number of seconds")
    if dashboard_port is not None and not 0 <= dashboard_port <= 65535:
        raise ValueError(f"--dashboard-port {dashboard_port} must be a TCP port (0: any free port)")
    if not (min_run_s >= 0 and min_run_s < 1e6):
        raise ValueError(f"--min-run-s {min_run_s} must be a number of seconds >= 0")
    for flag, value, low, high in (("--launch-timeout-s", launch_timeout_s, 1.0, 86400.0),
                                   ("--hang-factor", hang_factor, 1.0, 1000.0),
                                   ("--hang-floor-s", hang_floor_s, 1.0, 86400.0),
                                   ("--hang-first-step-s", hang_first_step_s, 1.0, 86400.0)):
        if not (isinstance(value, (int, float)) and low <= value <= high):
            raise ValueError(f"{flag} {value!r} must be between {low:g} and {high:g}")
    types = tuple(slots)
    overrides = dict(slowdowns or {})
    unknown = [t for t in overrides if t not in slots]
    if unknown:
        raise ValueError(f"--slowdowns names type(s) {unknown} that are not in --slots {list(slots)}")
    type_slowdowns(types, gavel_table(), overrides)  # every type's speed is known
    placement = placement_of(backend, address=address, cpus_per_worker=cpus_per_worker,
                             emulate_slowdowns=emulate_slowdowns)
    placement.check_slots(slots)  # on Ray: connects and checks the resources the slots claim
    db = ClusterDB(cluster_dir, create=True)  # checks the directory (and makes it 0700 if missing)
    if db.recreated_over is not None:
        db.event("database_new", earlier_ids_up_to=db.recreated_over)
        log.warning("%s was new, but this directory handed out job ids up to %d before: new ids continue above",
                    db.path, db.recreated_over)
    db.set_meta("config", {"slots": slots, "policy": policy, "round_s": round_s, "slowdowns": overrides,
                           "threads_per_worker": threads_per_worker, "min_run_s": min_run_s,
                           "dashboard_port": dashboard_port, "backend": backend, "address": address,
                           "cpus_per_worker": cpus_per_worker, "emulate_slowdowns": emulate_slowdowns,
                           "mechanism": knobs, "launch_timeout_s": launch_timeout_s, "hang_factor": hang_factor,
                           "hang_floor_s": hang_floor_s, "hang_first_step_s": hang_first_step_s})
    token_path = os.path.join(cluster_dir, "token")
    if not os.path.exists(token_path):
        from virtualflow.comm import auth

        auth.write_token(token_path, auth.new_token())
    return db
