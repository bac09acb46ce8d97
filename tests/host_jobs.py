"""Jobs for the tests and the benchmark on hosts (tests/e2e/test_host_faults.py, bench/hosts.py).

``link_job``: a small classifier whose gradient (~0.5 MB) is large against its compute, so the
step's time is the reduction's whenever a link is slow; deterministic mode bit-identical like
every job of tests/jobs.py.
"""

from __future__ import annotations

from torch import nn

import virtualflow as vf
from jobs import FEATURES, adam, classification_data, cross_entropy, step_lr

LINK_HIDDEN = 256


def link_net() -> nn.Module:
    """About 70 k parameters (0.28 MB of float32 gradient), no BatchNorm, no dropout."""
    return nn.Sequential(nn.Linear(FEATURES, LINK_HIDDEN), nn.ReLU(), nn.Linear(LINK_HIDDEN, LINK_HIDDEN), nn.ReLU(),
                         nn.Linear(LINK_HIDDEN, 3))


def link_job() -> vf.Job:
    return vf.Job(name="link", model=link_net, optimizer=adam, loss=cross_entropy, dataset=classification_data,
                  global_batch_size=48, virtual_nodes=6, lr_scheduler=step_lr, seed=4)
