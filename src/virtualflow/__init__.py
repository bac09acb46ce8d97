"""virtualflow: train the same model on any hardware.

A :class:`Job` fixes what the model sees (global batch size B, virtual nodes V, seed, ...);
:func:`train` maps its V virtual nodes onto however many workers exist and returns a
:class:`Result` that does not depend on that mapping.

This module is the public surface: the names in ``__all__`` are what users import (together
with the public subpackages the architecture guide in ``docs/`` names). Everything else is internal and
may move; old import paths keep working for a while through deprecated aliases.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for type checkers and readers; at run time they load on first use
    from virtualflow.api import JobHandle, launch, train
    from virtualflow.config.faults import Fault, FaultPlan
    from virtualflow.config.job import Job, JobImportError
    from virtualflow.config.loop import Callback, StepInfo
    from virtualflow.config.options import LaunchOptions
    from virtualflow.config.pipeline import Pipeline
    from virtualflow.config.spec import WorkerSpec
    from virtualflow.config.streaming import StreamingDataset
    from virtualflow.plan.data import vn_seed
    from virtualflow.plan.permutation import epoch_indices
    from virtualflow.plan.flops import transformer_flops
    from virtualflow.records.result import Result, TrainingError
    from virtualflow.runtime.engine import LossShapeError, NonFiniteLossError

# Public name -> the module that defines it. Importing ``virtualflow`` loads none of them (so
# ``virtualflow --help`` or ``import virtualflow.records`` does not pay for torch); the first
# ``virtualflow.Job`` (or ``from virtualflow import Job``) imports its module once (PEP 562).
_EXPORTS: dict[str, str] = {
    "JobHandle": "virtualflow.api",
    "launch": "virtualflow.api",
    "train": "virtualflow.api",
    "Fault": "virtualflow.config.faults",
    "FaultPlan": "virtualflow.config.faults",
    "Job": "virtualflow.config.job",
    "JobImportError": "virtualflow.config.job",
    "Callback": "virtualflow.config.loop",
    "StepInfo": "virtualflow.config.loop",
    "LaunchOptions": "virtualflow.config.options",
    "Pipeline": "virtualflow.config.pipeline",
    "WorkerSpec": "virtualflow.config.spec",
    "StreamingDataset": "virtualflow.config.streaming",
    "vn_seed": "virtualflow.plan.data",
    "epoch_indices": "virtualflow.plan.permutation",
    "transformer_flops": "virtualflow.plan.flops",
    "Result": "virtualflow.records.result",
    "TrainingError": "virtualflow.records.result",
    "LossShapeError": "virtualflow.runtime.engine",
    "NonFiniteLossError": "virtualflow.runtime.engine",
}

__all__ = [
    "Callback",
    "StepInfo",
    "WorkerSpec",
    "Fault",
    "FaultPlan",
    "Job",
    "JobHandle",
    "JobImportError",
    "LaunchOptions",
    "LossShapeError",
    "Pipeline",
    "NonFiniteLossError",
    "Result",
    "StreamingDataset",
    "TrainingError",
    "epoch_indices",
    "launch",
    "train",
    "transformer_flops",
    "vn_seed",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'virtualflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
