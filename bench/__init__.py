"""virtualflow's benchmarks.

Run one from the repository root as a module, e.g. ``python -m bench.vs_ddp --quick``; every
benchmark takes ``--quick``, ``--out``, ``--name`` and ``--target KEY=LIMIT`` (see
``bench/harness/``), prints each target with "met" or "NO", and exits non-zero when one is
missed. Results and how to read them: ``bench/results/README.md``.
"""
