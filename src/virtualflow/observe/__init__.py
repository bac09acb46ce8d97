"""Observability beside the step breakdown (:mod:`virtualflow.runtime.breakdown`): TensorBoard event
files written by the launching process (:mod:`virtualflow.observe.tensorboard`), importing
TensorBoard lazily, only when asked for. The torch.profiler window of steps runs inside each worker
and is :mod:`virtualflow.runtime.trace_window` (``observe.profiler`` is its deprecated alias).

Experiment trackers run as ``Job.callbacks`` on the worker of rank 0: :class:`MLflowLogger` and
:class:`WandbLogger` (:mod:`virtualflow.observe.loggers`), importing their package at the first
step."""

from virtualflow.observe.loggers import MLflowLogger, WandbLogger

__all__ = ["MLflowLogger", "WandbLogger"]
