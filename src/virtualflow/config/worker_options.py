"""The worker knobs, as one object: :class:`WorkerOptions`.

Purpose: the options every worker process reads (how gradients are combined, deterministic
mode and its exchange, the device, the loader threads, the breakdown, the checkpoint format...)
travel from the launching process to the engine *whole*, as one value, instead of being copied
name by name into the worker's configuration and again into each engine's parameters.

:class:`WorkerOptions` is derived from :class:`~virtualflow.config.options.LaunchOptions` by a
loop over its fields: every field declared with ``_opt(..., worker=True)`` is a field here, of
the same name, type and default. So a new worker knob is written in two places: its
``LaunchOptions`` field (marked ``worker=True``) and the one place that reads it
(``cfg.options.NAME``). :meth:`WorkerOptions.of` copies the values of a validated
``LaunchOptions``; ``help(WorkerOptions)`` lists each field with its help text.

Invariants: frozen (a worker never changes an option); plain values only, picklable (it is
pickled to a local worker, sent through a Ray actor call and to external workers), and
importable by name (``virtualflow.config.worker_options.WorkerOptions``) for unpickling.
Values are as given in ``LaunchOptions`` (validated there); what the launching process
*resolves* from them (threads, the starting workers, the slowdowns) is
:class:`~virtualflow.runtime.worker_config.WorkerConfig`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from virtualflow.config.option_text import profile_window
from virtualflow.config.options import LaunchOptions

__all__ = ["WorkerOptions"]


def _fields() -> list[tuple[str, Any, Any]]:
    """``(name, type, field)`` of every worker knob of :class:`LaunchOptions`, in table order."""
    out = []
    for f in dataclasses.fields(LaunchOptions):
        if f.metadata.get("worker"):
            out.append((f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory,
                                                          metadata=f.metadata)))
    return out


def _of(cls: type, options: LaunchOptions) -> Any:
    """The worker knobs of ``options`` (validated there), as given."""
    return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(cls)})


def _profile_steps(self: Any) -> tuple[int, int] | None:
    """``[first, last)`` steps to trace with ``torch.profiler`` (None: no trace), as
    :attr:`LaunchOptions.profile_steps`."""
    return profile_window(self.profile) if self.profile is not None else None


def _doc(fields: list[tuple[str, Any, Any]]) -> str:
    lines = ["The worker knobs of :class:`~virtualflow.config.options.LaunchOptions`, passed whole from the",
             "launching process to the engine (see the module's docstring). Fields:", ""]
    lines += [f"- ``{name}`` ({kind}, default ``{f.default!r}``): {f.metadata['help']}" for name, kind, f in fields]
    return "\n".join(lines)


def _derive() -> type:
    """The frozen, slotted dataclass of the worker knobs, with :meth:`of` and ``profile_steps``;
    its ``__module__`` names this module, where pickle finds it."""
    fields = _fields()
    namespace = {"__module__": __name__, "__doc__": _doc(fields), "of": classmethod(_of),
                 "profile_steps": property(_profile_steps)}
    return dataclasses.make_dataclass("WorkerOptions", fields, namespace=namespace, frozen=True, slots=True,
                                      kw_only=True)


WorkerOptions = _derive()
"""The class (built once, at import, from the table: see the module's docstring)."""
