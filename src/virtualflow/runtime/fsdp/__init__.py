"""``reduction="fsdp"``: fully sharded parameters (ZeRO-3 / FSDP2) in the VN engine.

:mod:`~virtualflow.runtime.fsdp.units` picks the sharding units, :mod:`.store` holds the shards
and gathers them, :mod:`.reduce` reduces each unit's gradient, :mod:`.update` steps the shards
and assembles the whole state, :mod:`.body` runs a step's VNs in rounds, :mod:`.reshard` moves
shards at a resize. :class:`FsdpKnobs` carries the launch's knobs to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["FsdpKnobs"]


@dataclass(frozen=True)
class FsdpKnobs:
    """The ``LaunchOptions`` knobs of ``reduction="fsdp"`` (see their help there)."""

    shard_units: tuple[str, ...] | None = None
    keep_gathered: bool = False
    offload: str | None = None
    param_dtype: str | None = None
    reduce_dtype: str = "fp32"

    @classmethod
    def of(cls, options: Any) -> "FsdpKnobs":
        return cls(options.shard_units, options.keep_gathered, options.offload, options.param_dtype,
                   options.reduce_dtype)

    def update(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *,
               deterministic: bool, device: torch.device) -> Any:
        """The engine's :class:`~virtualflow.runtime.fsdp.update.FsdpUpdate` for ``model``."""
        from virtualflow.runtime.fsdp.units import resolve_units, unit_params
        from virtualflow.runtime.fsdp.update import FsdpUpdate
        units = unit_params(model, resolve_units(model, self.shard_units))
        return FsdpUpdate(optimizer, model, params, units, deterministic=deterministic, device=device,
                          offload=self.offload, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                          keep_gathered=self.keep_gathered)
