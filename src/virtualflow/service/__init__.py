"""The cluster service: a scheduler that runs real virtualflow jobs on a shared set of slots.

- :mod:`~virtualflow.service.state`: the SQLite database of a cluster directory (jobs,
  allocations, rounds, events);
- :mod:`~virtualflow.service.core`: the pure decisions (estimates, policy + round mechanism,
  the actions that enact a round, recovery after a crash);
- :mod:`~virtualflow.service.runner`: the process layer (rounds in real time, jobs through
  :func:`virtualflow.launch` and their handles);
- :mod:`~virtualflow.service.dashboard`: the web dashboard (Starlette, loopback only).

The command line is ``virtualflow cluster start|status|stop|dashboard``, ``virtualflow submit``,
``virtualflow queue`` and ``virtualflow cancel`` (``virtualflow.cli.cluster``); the guide is
``docs/cluster_service.md``.
"""
