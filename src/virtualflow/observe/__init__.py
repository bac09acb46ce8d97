"""What a run reports to the tools users watch it with, beside the step breakdown
(:mod:`virtualflow.runtime.breakdown`) and the run directory's records.

- Experiment trackers as ``Job.callbacks`` on the worker of rank 0: :class:`MLflowLogger` and
  :class:`WandbLogger` (:mod:`virtualflow.observe.loggers`), importing their package at the first
  step.
- TensorBoard event files written by the launching process from the step records
  (:mod:`virtualflow.observe.tensorboard`), importing TensorBoard lazily, only when asked for.

Why a layer of its own (9, above ``runtime/``): both halves read the runtime's records (the
breakdown's parts, the step's fields) and neither belongs to one worker or to the launching
process alone, and ``virtualflow.observe`` is the import path the guides give users
(docs/observability.md). The torch.profiler window runs inside each worker and is
:mod:`virtualflow.runtime.trace_window`."""

from virtualflow.observe.loggers import MLflowLogger, WandbLogger

__all__ = ["MLflowLogger", "WandbLogger"]
