"""Observability beside the step breakdown (:mod:`virtualflow.runtime.breakdown`): torch.profiler
traces of a window of steps on every worker, and TensorBoard event files written by the launching
process. Both import their heavy dependency lazily, only when asked for."""
