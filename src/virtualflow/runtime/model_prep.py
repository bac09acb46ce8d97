"""What a worker does to its model before training: activation checkpointing, then compile.

Purpose: :func:`prepare_model` applies a job's ``activation_checkpointing`` and ``compile`` to a
model (the VN engine's) or a piece (a pipeline stage's), in place, once per worker.

Invariants.

* *The same model.* Checkpointing wraps a module's ``forward`` in non-reentrant
  ``torch.utils.checkpoint.checkpoint``, which saves the random generators' state at the forward
  and restores it for the recompute, so dropout draws the same mask twice, and the outer random
  stream is not advanced by the recompute: the gradients are those of the plain model.
  Parameter names and ``state_dict`` keys do not change (the forward is replaced on the
  instance, not wrapped in another module), so checkpoints, state transfers and resumes work
  with any setting.
* *Compiled once.* The model's ``forward`` is compiled in place (``state_dict`` keys unchanged); every
  virtual node of every step then calls the same compiled module with the same input shapes (a
  virtual node's batch size is fixed by the job), so dynamo compiles on the first call and never
  again, whatever the number of virtual nodes, steps or generations.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "blocks_of", "compile_model", "prepare_model", "select_named"]


def blocks_of(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """What ``"every"`` checkpoints: the children of the model when it is an ``nn.Sequential`` or
    ``nn.ModuleList``, else the children of the first such container found breadth-first (a
    transformer's stack of blocks)."""
    queue: list[tuple[str, torch.nn.Module]] = [("", model)]
    while queue:
        name, module = queue.pop(0)
        if isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList)) and len(module):
            prefix = f"{name}." if name else ""
            return [(prefix + child_name, child) for child_name, child in module.named_children()]
        prefix = f"{name}." if name else ""
        queue.extend((prefix + n, m) for n, m in module.named_children())
    return []


def _selected(model: torch.nn.Module, spec: Any) -> list[tuple[str, torch.nn.Module]]:
    if spec == "every":
        found = blocks_of(model)
        if not found:
            raise ValueError(f"activation_checkpointing='every' checkpoints the blocks of the model's first "
                             f"nn.Sequential/nn.ModuleList, and {type(model).__name__} has none; name the modules "
                             f"(activation_checkpointing=['layer1', ...]) or give a module class")
        return found
    modules = dict(model.named_modules())
    if isinstance(spec, type):
        found = [(n, m) for n, m in modules.items() if isinstance(m, spec) and n]
        if not found:
            raise ValueError(f"activation_checkpointing={spec.__name__}: the model has no module of that class")
        return found
    return select_named(model, spec, "activation_checkpointing=", "")


def select_named(model: torch.nn.Module, names: Any, knob: str, flag: str) -> list[tuple[str, torch.nn.Module]]:
    """The modules ``names`` picks: each entry a module name, or a class name (every module of
    that class); an entry that is neither raises ``ValueError`` naming ``knob`` (and ``flag``)."""
    modules = dict(model.named_modules())
    found, missing = [], []
    for name in names:
        if name in modules and name:
            found.append((name, modules[name]))
            continue
        by_class = [(n, m) for n, m in modules.items() if type(m).__name__ == name and n]
        if by_class:
            found.extend(by_class)
        else:
            missing.append(name)
    if missing:
        known = [n for n in modules if n][:12]
        where = f" ({flag})" if flag else ""
        raise ValueError(f"{knob}{list(names)!r}: {missing} are neither module names nor class names of "
                         f"{type(model).__name__} (its modules include {known}); fix {knob}{where}")
    return found


def _checkpointed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation, or a recompute's own no-grad forward
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.__virtualflow_checkpointed__ = True  # type: ignore[attr-defined]
    return run


def apply_activation_checkpointing(model: torch.nn.Module, spec: Any) -> list[str]:
    """Checkpoint the modules ``spec`` selects (see ``Job.activation_checkpointing``); returns their
    names. A module inside another selected one is left alone (the outer recompute covers it)."""
    if spec is None:
        return []
    chosen = _selected(model, spec)
    names = [n for n, _ in chosen]
    done = []
    for name, module in chosen:
        if any(name.startswith(other + ".") for other in names if other != name):
            continue
        if getattr(module.forward, "__virtualflow_checkpointed__", False):
            continue
        module.forward = _checkpointed(module.forward)
        done.append(name)
    return done


def compile_model(model: torch.nn.Module, spec: bool | Mapping[str, Any]) -> None:
    """``torch.compile`` the model's ``forward`` in place (``spec`` True: torch.compile's
    defaults). Not ``nn.Module.compile``: on torch's own containers (an ``nn.Sequential``, a
    pipeline piece) dynamo skips the module's call and compiles nothing; the bound ``forward``
    is compiled whatever the module's class, and ``state_dict`` keys stay as they are."""
    if spec is False:
        return
    kwargs = dict(spec) if isinstance(spec, Mapping) else {}
    model.forward = torch.compile(model.forward, **kwargs)


def prepare_model(model: torch.nn.Module, *, activation_checkpointing: Any = None,
                  compile: bool | Mapping[str, Any] = False) -> list[str]:
    """Checkpointing, then compile; returns the checkpointed modules' names."""
    names = apply_activation_checkpointing(model, activation_checkpointing)
    compile_model(model, compile)
    return names
