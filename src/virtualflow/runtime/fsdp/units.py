"""Which modules are ``reduction="fsdp"``'s sharding units, and the checks made before any worker starts.

Purpose: a *unit* is the set of parameters gathered together before a module's forward and
reduced together after its backward (FSDP2 applies ``fully_shard`` per transformer block; the
model's remaining parameters form the *root* unit, gathered for the whole forward and backward).
:func:`resolve_units` picks the unit modules from ``LaunchOptions.shard_units`` the way
``activation_checkpointing`` picks modules (the blocks of the model's first
``nn.ModuleList``/``nn.Sequential`` by default, else module names or class names);
:func:`unit_params` lists each unit's trainable parameters; :func:`check_units` refuses the
layouts that cannot work, with the value, the rule and the knob.

Invariants: the units' parameter lists are disjoint and cover every trainable parameter once
(the root unit takes what no unit module holds); a parameter held by two units (a weight shared
between blocks) is refused, as a unit nested in another one is (name the outer one only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from virtualflow.runtime.model_prep import blocks_of

__all__ = ["ROOT", "Unit", "check_units", "resolve_units", "unit_params"]

ROOT = "<root>"
"""The name of the root unit: every trainable parameter outside the unit modules."""


@dataclass
class Unit:
    """One sharding unit: its module (None for the root unit), and its trainable parameters in
    ``model.named_parameters()`` order."""

    name: str
    module: torch.nn.Module | None
    names: list[str]
    params: list[torch.nn.Parameter]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def resolve_units(model: torch.nn.Module, spec: Sequence[str] | None) -> list[tuple[str, torch.nn.Module]]:
    """The unit modules, in ``model.named_modules()`` order. ``spec`` None: the blocks of the
    model's first ``nn.ModuleList``/``nn.Sequential`` (as FSDP2 is applied per transformer block);
    else each entry is a module name or a class name."""
    if spec is None:
        found = blocks_of(model)
        if not found:
            raise ValueError(f"reduction='fsdp' shards the blocks of the model's first nn.ModuleList/nn.Sequential by "
                             f"default, and {type(model).__name__} has none; name the unit modules "
                             f"(shard_units=['layer1', ...], --shard-units) or give a class name")
        return found
    modules = dict(model.named_modules())
    found: dict[str, torch.nn.Module] = {}
    missing = []
    for name in spec:
        if name and name in modules:
            found[name] = modules[name]
            continue
        by_class = [(n, m) for n, m in modules.items() if type(m).__name__ == name and n]
        if by_class:
            found.update(by_class)
        else:
            missing.append(name)
    if missing:
        known = [n for n in modules if n][:12]
        classes = sorted({type(m).__name__ for n, m in modules.items() if n})[:12]
        raise ValueError(f"shard_units={list(spec)!r}: {missing} are neither module names nor class names of "
                         f"{type(model).__name__} (its modules include {known}; classes {classes}); fix "
                         f"shard_units= (--shard-units)")
    order = {n: i for i, n in enumerate(modules)}
    names = sorted(found, key=order.__getitem__)
    for n in names:
        outer = [o for o in names if o != n and n.startswith(o + ".")]
        if outer:
            raise ValueError(f"shard_units: unit {n!r} lies inside unit {outer[0]!r}; a parameter belongs to one unit, "
                             f"so name the outer module or the inner ones, not both (--shard-units)")
    return [(n, found[n]) for n in names]


def unit_params(model: torch.nn.Module, chosen: Sequence[tuple[str, torch.nn.Module]]) -> list[Unit]:
    """Each unit's trainable parameters, the root unit last (omitted when it holds none).
    A parameter reachable from two units raises ``ValueError``."""
    owner: dict[int, str] = {}
    units = []
    for name, module in chosen:
        names, params = [], []
        for pname, p in module.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                continue
            if id(p) in owner and owner[id(p)] != name:
                raise ValueError(f"reduction='fsdp': parameter {name}.{pname} is shared by units {owner[id(p)]!r} and "
                                 f"{name!r}; a unit's parameters are gathered and reduced together, so a shared weight "
                                 f"must lie in one unit: choose units that hold both users (shard_units=, "
                                 f"--shard-units), or reduction='sharded'")
            if id(p) in owner:
                continue  # the same weight twice inside one unit
            owner[id(p)] = name
            names.append(f"{name}.{pname}")
            params.append(p)
        if params:  # (a module without trainable parameters, e.g. an activation in a Sequential, is no unit)
            units.append(Unit(name, module, names, params))
    root_names, root_params = [], []
    for pname, p in model.named_parameters():
        if p.requires_grad and id(p) not in owner:
            root_names.append(pname)
            root_params.append(p)
    # a weight used both in a unit and outside it (tied to the root): named twice in the model
    unit_of = {id(p): u.name for u in units for p in u.params}
    for pname, p in model.named_parameters(remove_duplicate=False):
        outside = not any(pname == c[0] or pname.startswith(c[0] + ".") for c in chosen)
        if p.requires_grad and outside and id(p) in unit_of:
            raise ValueError(f"reduction='fsdp': parameter {pname} is the same tensor as one of unit "
                             f"{unit_of[id(p)]!r}, used outside it; a shared weight must lie in one unit: choose "
                             f"units that hold both users (shard_units=, --shard-units), or reduction='sharded'")
    if root_params:
        units.append(Unit(ROOT, None, root_names, root_params))
    return units


def check_units(units: Sequence[Unit], workers: int) -> None:
    """Refuse ``workers`` larger than a unit's element count (a worker would own nothing of it)."""
    for u in units:
        if u.numel and workers > u.numel:
            raise ValueError(f"reduction='fsdp' with {workers} workers: unit {u.name!r} has {u.numel} elements, fewer "
                             f"than workers, so some worker would own none of it; use at most {u.numel} workers "
                             f"(--workers), larger units (shard_units=, --shard-units), or reduction='sharded'")
