"""Job files for the cluster-service tests (tests/test_service*.py): small, paced jobs from
tests/jobs.py, and one that crashes."""

from __future__ import annotations

import jobs


def paced() -> "jobs.vf.Job":
    """No BatchNorm, no dropout, SGD with momentum and an LR schedule; ~4 ms of sleep per 8
    samples, so steps are long enough for rounds, resizes and preemptions to land mid-run."""
    return jobs.paced_regression_job()


def paced_adam() -> "jobs.vf.Job":
    """BatchNorm, dropout, Adam and an LR schedule: everything a move or resize must carry."""
    return jobs.elastic_job()


def crashing() -> "jobs.vf.Job":
    """Fails in its first steps (one sample of its dataset raises)."""
    return jobs.crashing_job()


def _slow_paced_mse(model, batch):
    jobs.time.sleep(0.012 * len(batch[0]) / 8)  # 12 ms per 8 samples: about 0.1 s a step on one worker
    return jobs.mse(model, batch)


def paced_slow() -> "jobs.vf.Job":
    """``paced`` three times slower per sample (sleep-bound: a step takes about 0.1 s on one
    worker on any machine), so it is still running when later jobs arrive."""
    return jobs.paced_regression_job().replace(loss=_slow_paced_mse)
