"""Mixed precision for a step: the autocast region and loss scaling whose decisions are global.

Purpose: :func:`autocast` is the region a virtual node's forward and loss run in (a pipeline
stage's piece and, on the last stage, the loss); :class:`LossScaler` is ``"16-mixed"``'s dynamic
loss scale.

Invariants.

* *Master weights stay float32.* Only the ops inside the autocast region run in bfloat16/float16;
  parameters, gradients and optimizer state keep the model's dtype.
* *One scale for the whole step, one decision for the whole step.* Every virtual node's loss is
  multiplied by the same scale before its backward; the scaler looks for inf/nan in the **reduced**
  gradient (an inf in any virtual node's gradient makes the sum non-finite), which every worker
  holds identically (or, sharded, whose verdict the workers all-reduce), so a step is skipped on
  every worker or on none, and the scale evolves identically whatever the worker count.
* *torch.amp.GradScaler's rule and numbers.* Unscaling multiplies by the float32 reciprocal of the
  scale (``scale.double().reciprocal().float()``); after a skipped step the scale is multiplied by
  ``backoff_factor``, after ``growth_interval`` applied steps in a row by ``growth_factor``. The
  ``state_dict`` has GradScaler's keys, so a plain PyTorch loop and this scaler can be compared
  and their states exchanged.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager, Iterable

import torch

from virtualflow.config.loop import autocast_dtype, scaler_settings

__all__ = ["LossScaler", "NoLossScale", "autocast"]


def autocast(device: torch.device, precision: str) -> ContextManager[Any]:
    """``torch.autocast`` on ``device`` with ``precision``'s dtype; a no-op for ``"32"``."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """``"16-mixed"``'s dynamic loss scale (see the module docstring)."""

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        s = scaler_settings(settings)
        self.scale = float(s["init_scale"])
        self.growth_factor = float(s["growth_factor"])
        self.backoff_factor = float(s["backoff_factor"])
        self.growth_interval = int(s["growth_interval"])
        self.growth_tracker = 0
        """Applied steps in a row since the scale last changed."""

    @classmethod
    def of(cls, precision: str, loss_scale: dict[str, Any] | None) -> LossScaler | None:
        """The scaler a job with this precision needs (``None`` unless ``"16-mixed"``)."""
        return cls(loss_scale) if precision == "16-mixed" else None

    def _scale_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.scale, dtype=torch.float32, device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (GradScaler.scale)."""
        return loss * self._scale_tensor(loss.device)

    def inv_scale(self, device: torch.device) -> torch.Tensor:
        """The float32 factor that unscales a gradient (GradScaler's)."""
        return self._scale_tensor(device).double().reciprocal().float()

    def unscale_(self, tensors: Iterable[torch.Tensor]) -> None:
        """Divide gradients (or a chunk of the flat gradient) by the scale, in place."""
        tensors = [t for t in tensors if t is not None and t.numel()]
        if tensors:
            inv = self.inv_scale(tensors[0].device)
            torch._foreach_mul_(tensors, inv) if len(tensors) > 1 else tensors[0].mul_(inv)

    def found_inf(self, grads: list[torch.Tensor], any_of: Callable[[float], float]) -> float:
        """Unscale ``grads`` in place; 1.0 if one of them holds an inf/nan (after ``any_of``, which
        joins the flags of the holders of one tensor-parallel group) else 0.0."""
        self.unscale_(grads)
        found = float(not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())) if grads else 0.0
        return any_of(found)

    def skips(self, norm: float) -> bool:
        """Whether a step whose whole gradient has norm ``norm`` is skipped (inf/nan)."""
        return not math.isfinite(norm)

    def skips_flagged(self, flags: float | torch.Tensor) -> bool:
        """Whether a step is skipped when ``flags`` holders found an inf/nan."""
        return bool(flags > 0)

    def checkpoint_entries(self) -> dict[str, Any]:
        """The scaler's entry of a checkpoint's small state."""
        return {"grad_scaler": self.state_dict()}

    def load_entries(self, state: dict[str, Any]) -> None:
        """Load the scaler's entry of a whole state (``"grad_scaler"``), if it has one."""
        if state.get("grad_scaler") is not None:
            self.load_state_dict(state["grad_scaler"])

    def update(self, found_inf: bool) -> None:
        """After a step: back off when it was skipped, grow after ``growth_interval`` applied steps."""
        if found_inf:
            self.scale = _as_float32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _as_float32(self.scale * self.growth_factor)
            if grown != float("inf"):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's ``state_dict`` format."""
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])


class NoLossScale:
    """No loss scaling (every precision but ``"16-mixed"``): the loss and gradients are left as
    they are, no step is skipped for an inf/nan gradient, and nothing is saved. It answers
    :class:`LossScaler`'s questions so that a step asks no precision question."""

    scale = None
    """No scale (what a step's outcome reports as its ``loss_scale``)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, tensors: Iterable[torch.Tensor]) -> None:
        pass

    def found_inf(self, grads: list[torch.Tensor], any_of: Callable[[float], float]) -> float:
        return 0.0

    def skips(self, norm: float) -> bool:
        return False

    def skips_flagged(self, flags: float | torch.Tensor) -> bool:
        return False

    def checkpoint_entries(self) -> dict[str, Any]:
        return {}

    def load_entries(self, state: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def update(self, found_inf: bool) -> None:
        pass


def _as_float32(value: float) -> float:
    """GradScaler's arithmetic: the product in double, rounded to the float32 the scale is kept in."""
    return float(torch.tensor(value, dtype=torch.float32))
