"""Observability beside the step breakdown (:mod:`virtualflow.runtime.breakdown`): TensorBoard event
files written by the launching process (:mod:`virtualflow.observe.tensorboard`), importing
TensorBoard lazily, only when asked for. The torch.profiler window of steps runs inside each worker
and is :mod:`virtualflow.runtime.trace_window` (``observe.profiler`` is its deprecated alias)."""
