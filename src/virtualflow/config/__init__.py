"""What users write: the job, its pipeline, the launch options, worker specs, fault plans.

The config layer imports only ``plan/``, ``records/`` and ``parallel/``; every layer above reads
the objects it is given.
"""
