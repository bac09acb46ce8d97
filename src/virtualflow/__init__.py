"""virtualflow: train the same model on any hardware.

A :class:`Job` fixes what the model sees (global batch size B, virtual nodes V, seed, ...);
:func:`train` maps its V virtual nodes onto however many workers exist and returns a
:class:`Result` that does not depend on that mapping.
"""

from virtualflow.api import JobHandle, Result, TrainingError, launch, train
from virtualflow.options import LaunchOptions
from virtualflow.job import Job, JobImportError
from virtualflow.pipeline import Pipeline
from virtualflow.plan.data import vn_seed
from virtualflow.runtime.engine import LossShapeError, NonFiniteLossError
from virtualflow.runtime.faults import Fault, FaultPlan
from virtualflow.spec import WorkerSpec

__all__ = [
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
    "TrainingError",
    "launch",
    "train",
    "vn_seed",
]
__version__ = "0.1.0"
