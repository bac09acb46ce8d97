"""Process-group generations over a shared TCPStore.

Every membership generation ``g`` gets a fresh group built on ``PrefixStore(f"gen/{g}", store)``:
prefixes are never reused, so no key of an old generation can be read by a new one. Groups are
constructed directly (not through ``init_process_group``), so one process can hold several
generations over its life and two jobs can live in one process.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class Group:
    """One generation's process group, or a trivial one for a single worker."""

    generation: int
    rank: int
    size: int
    pg: dist.ProcessGroup | None

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        if self.pg is None:
            return _Done() if async_op else None
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        work = self.pg.allreduce([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.pg is None:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()


class _Done:
    def wait(self) -> bool:
        return True


def make_group(
    store: dist.Store, generation: int, rank: int, size: int, timeout_s: float, device: torch.device
) -> Group:
    """Build generation ``generation``'s group (gloo on CPU, NCCL on CUDA)."""
    if size == 1:
        return Group(generation, 0, 1, None)
    prefix = dist.PrefixStore(f"gen/{generation}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefix, rank, size, opts)
    else:
        pg = dist.ProcessGroupGloo(prefix, rank, size, timeout)
    return Group(generation, rank, size, pg)
