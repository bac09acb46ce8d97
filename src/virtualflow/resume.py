"""Resuming a job: find the newest good state of a run and check that it belongs to the job.

Corrupt or truncated state files are reported and skipped; a state from a different job (other
B, V, seed or model shapes) is refused with a message naming what differs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from virtualflow.job import Job
from virtualflow.runtime.checkpoint import CorruptCheckpointError, load_state

logger = logging.getLogger("virtualflow")


def find_resume_state(resume: str, job: Job) -> tuple[str, int]:
    """The newest good state file under ``resume`` (a run directory or a state file) that belongs
    to ``job``; corrupt or truncated files are reported and skipped."""
    if os.path.isdir(resume):
        folder = os.path.join(resume, "checkpoints")
        names = sorted(f for f in os.listdir(folder) if f.startswith("step-") and f.endswith(".pt")) if os.path.isdir(folder) else []
        candidates = [os.path.join(folder, f) for f in reversed(names)]
        if not candidates:
            raise ValueError(
                f"resume={resume!r}: no checkpoints in {folder}; a run writes them with "
                f"checkpoint_every= (--checkpoint-every N)"
            )
    elif os.path.isfile(resume):
        candidates = [resume]
    else:
        raise ValueError(f"resume={resume!r} is neither a run directory nor a checkpoint file")
    problems = []
    for path in candidates:
        try:
            state = load_state(path)
        except CorruptCheckpointError as exc:
            logger.warning("skipping %s: %s", path, exc)
            problems.append(str(exc))
            continue
        _check_same_job(path, state, job)
        if problems:
            logger.warning("resuming from %s, the newest good checkpoint", path)
        return path, int(state["step"])
    raise ValueError(f"resume={resume!r}: no readable checkpoint ({'; '.join(problems)})")


def _check_same_job(path: str, state: dict[str, Any], job: Job) -> None:
    saved = state.get("job", {})
    for key in ("global_batch_size", "virtual_nodes", "seed"):
        if saved.get(key) != getattr(job, key):
            raise ValueError(
                f"the checkpoint {path} is from a different job: its {key}={saved.get(key)!r}, the job's is "
                f"{getattr(job, key)!r}. Resume with the same {key} (--{key.replace('_', '-')}), or start a new run"
            )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        expected = {k: tuple(v.shape) for k, v in job.model().state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state["model"].items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:3]
        raise ValueError(
            f"the checkpoint {path} holds a different model than the job's (first differences: {diff}); "
            f"resume it with the job that wrote it"
        )
