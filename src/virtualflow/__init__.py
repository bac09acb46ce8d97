"""virtualflow: train the same model on any hardware.

A :class:`Job` fixes what the model sees (global batch size B, virtual nodes V, seed, ...);
:func:`train` maps its V virtual nodes onto however many workers exist and returns a
:class:`Result` that does not depend on that mapping.

This module is the public surface: the names in ``__all__`` are what users import (together
with the public subpackages the architecture guide in ``docs/`` names). Everything else is internal and
may move; old import paths keep working for a while through deprecated aliases.
"""

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
