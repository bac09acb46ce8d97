"""Run records: the run directory (atomic writes, locks, status and metrics files) and the result
of a run. Imports nothing else of virtualflow."""
