"""virtualflow's benchmarks.

Run one from the repository root as a module, e.g. ``python -m bench.vs_ddp --quick``; every
benchmark takes ``--quick``, ``--out``, ``--name`` and ``--target KEY=LIMIT`` (see
``bench/harness/``), prints each target with "met" or "NO", and exits non-zero when one is
missed. Results and how to read them: ``bench/results/README.md``.

Layout:

* ``bench/NAME.py`` - one benchmark; the four largest are packages ``bench/NAME/`` (``bamboo``,
  ``bamboo_failover``, ``pipeline``, ``coconet``: ``workload`` (names, targets, the job the workers
  import), the measuring parts, ``report`` (markdown), ``cli`` (flags and ``main``), and
  ``__main__`` so that ``python -m bench.NAME`` runs them as before).
* ``bench/harness/`` - what benchmarks share: workloads, the machine-load meter, child processes,
  targets and result files, formatting (``report``), the one sleep-emulated timed layer
  (``emulated``: ``sleep_through``, ``EmulatedLinear``) and the sleep-emulated pipeline stages of
  the Bamboo benchmarks (``sleep_stages``).
* No benchmark imports another: what two of them share lives in ``bench/harness/``.
"""
