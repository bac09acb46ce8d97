"""The training-loop knobs of a job: precision, loss scaling, clipping, activation checkpointing,
compile, callbacks, and what a sample is worth in tokens and FLOPs.

Purpose: the checks of :class:`virtualflow.Job`'s loop fields, written once, with messages that
name the value, the rule and the knob; and the :class:`Callback` protocol users implement.

Invariants. Every knob here is about *what* the job computes, so it is a field of the job (the
same on any number of workers); the launch options may override ``precision``,
``max_grad_norm``, ``activation_checkpointing`` and ``compile`` (``--precision`` ...), which the
workers then receive as job overrides. ``precision="32"``, ``max_grad_norm=None``,
``activation_checkpointing=None``, ``compile=False`` and no callbacks train exactly the model
this project trained before these knobs existed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # torch loads where it is used: the CLI's parsers read this module without it
    import torch

__all__ = ["CALLBACK_METHODS", "PRECISIONS", "SCALER_KNOBS", "Callback", "StepInfo", "autocast_dtype", "check_activation_checkpointing",
           "check_compile", "check_loss_scale", "check_max_grad_norm", "check_precision", "scaler_settings"]

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
"""``"32"``: everything in float32 (the default); ``"bf16-mixed"``: forward and loss under
``torch.autocast`` with bfloat16, weights, gradients and optimizer state in float32;
``"16-mixed"``: the same with float16 and loss scaling (decisions taken over the whole step)."""

CALLBACK_METHODS = ("on_step_end", "on_eval", "on_resize", "on_train_end")

SCALER_KNOBS = {"init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
"""``Job.loss_scale``'s keys and defaults: those of ``torch.amp.GradScaler``."""


def check_precision(value: Any, knob: str = "Job.precision (--precision)") -> str:
    if value not in PRECISIONS:
        raise ValueError(f"precision={value!r} is not known; choose one of {', '.join(map(repr, PRECISIONS))} ({knob})")
    return value


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs the forward in, or ``None`` for ``"32"``."""
    import torch

    return {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[check_precision(precision)]


def check_max_grad_norm(value: Any, knob: str = "Job.max_grad_norm (--max-grad-norm)") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"max_grad_norm={value!r} must be a finite number > 0 (the largest global gradient norm "
                         f"a step applies) or None for no clipping ({knob})")
    return float(value)


def scaler_settings(loss_scale: Mapping[str, Any] | None) -> dict[str, float]:
    """``Job.loss_scale`` with ``torch.amp.GradScaler``'s defaults filled in."""
    return {**SCALER_KNOBS, **dict(loss_scale or {})}


def check_loss_scale(loss_scale: Any, precision: str) -> None:
    if loss_scale is None:
        return
    if not isinstance(loss_scale, Mapping):
        raise TypeError(f"Job.loss_scale must be a dict of torch.amp.GradScaler settings "
                        f"({', '.join(SCALER_KNOBS)}) or None, got {type(loss_scale).__name__}")
    if precision != "16-mixed":
        raise ValueError(f"Job.loss_scale={dict(loss_scale)!r} only applies to precision='16-mixed' (float16 needs "
                         f"loss scaling; precision={precision!r} does not): drop loss_scale or use --precision 16-mixed")
    unknown = sorted(set(loss_scale) - set(SCALER_KNOBS))
    if unknown:
        raise ValueError(f"Job.loss_scale has unknown keys {unknown}; the settings are {', '.join(SCALER_KNOBS)} "
                         f"(those of torch.amp.GradScaler)")
    s = scaler_settings(loss_scale)
    rules = {"init_scale": s["init_scale"] > 0, "growth_factor": s["growth_factor"] > 1,
             "backoff_factor": 0 < s["backoff_factor"] < 1,
             "growth_interval": isinstance(s["growth_interval"], int) and s["growth_interval"] >= 1}
    words = {"init_scale": "> 0", "growth_factor": "> 1", "backoff_factor": "in (0, 1)",
             "growth_interval": "a positive int"}
    for key, ok in rules.items():
        if isinstance(s[key], bool) or not isinstance(s[key], (int, float)) or not ok:
            raise ValueError(f"Job.loss_scale[{key!r}]={s[key]!r} must be {words[key]}")


def check_activation_checkpointing(value: Any, knob: str = "Job.activation_checkpointing (--activation-checkpointing)"
                                   ) -> Any:
    """``None``, ``"every"``, a module class, or module names (a list, or one comma-separated
    string: qualified names as ``model.named_modules()`` gives them, or class names)."""
    if value is None or value == "every":
        return value
    if isinstance(value, type):
        import torch

        if not issubclass(value, torch.nn.Module):
            raise TypeError(f"activation_checkpointing={value.__name__} is a class but not a torch.nn.Module; give a "
                            f"module class, module names or 'every' ({knob})")
        return value
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",") if n.strip()]
    elif isinstance(value, Sequence) and all(isinstance(n, str) for n in value):
        names = list(value)
    else:
        raise TypeError(f"activation_checkpointing={value!r} must be None, 'every', a torch.nn.Module class or a list "
                        f"of module names ({knob})")
    if not names:
        raise ValueError(f"activation_checkpointing={value!r} names no module; give module names, a module class or "
                         f"'every' ({knob})")
    return tuple(names)


def check_compile(value: Any, knob: str = "Job.compile (--compile)") -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return value
    raise TypeError(f"compile={value!r} must be True, False or a dict of torch.compile keyword arguments "
                    f"(e.g. {{'backend': 'aot_eager'}}) ({knob})")


class StepInfo(Protocol):
    """What a callback is told about a step (see :class:`Callback`)."""

    step: int
    """The step just applied (0-based); the model holds the weights after it."""
    loss: float
    metrics: dict[str, float]
    """The loss function's extra metrics, reduced over the global batch."""
    grad_norm: float | None
    """The whole step's gradient norm before clipping (``None`` without ``max_grad_norm``)."""
    skipped: bool
    """True when loss scaling skipped the step (``16-mixed``: an inf/nan gradient)."""
    lr: float | None
    workers: int
    rank: int
    model: torch.nn.Module


@runtime_checkable
class Callback(Protocol):
    """A step-boundary hook (``Job.callbacks``). Implement any of the methods; absent ones are
    skipped.

    ``ranks``: ``"zero"`` (default) runs the callback on rank 0 only (loggers, trackers, early
    stopping); ``"all"`` on every worker (state that every replica must hold, such as an EMA of the
    weights). A callback must not change the model or the optimizer unless that is its purpose;
    its ``state_dict``/``load_state_dict`` (optional) travel with checkpoints and state transfers,
    so EMA weights survive resizes, failures and resumes.

    ``on_step_end(info) -> bool | None``: after each applied (or skipped) step; returning ``True``
    (only ``True``: ``None``/``False`` go on, anything else is refused) asks the job to stop after
    this step on every worker (early stopping). ``on_eval(step, metrics)``: after each evaluation,
    on rank 0 only. ``on_resize(step, old_workers, new_workers)``: when a new generation starts
    training with another worker count. ``on_train_end(step)``: once, when the job ends (its
    last step, or a stop) and the final state is written, where the callback runs (a tracker
    closes its run there). ``state_dict()`` must return plain data (tensors, numbers,
    strings, lists, dicts): checkpoints are loaded with ``torch.load(weights_only=True)``.
    """

    def on_step_end(self, info: StepInfo) -> bool | None: ...
