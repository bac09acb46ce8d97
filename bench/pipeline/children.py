"""Child processes: the ranks run as ``python -m bench.pipeline --child-... JSON`` in fresh
interpreters (:func:`start_children`), driven over a store by :class:`Driver`.
"""

from __future__ import annotations

import datetime
import json
import weakref

import torch

from bench import harness as H
from bench.pipeline.workload import CPU, MODULE


# --------------------------------------------------------------------------------------------
# Child processes.


def start_children(mode: str, world: int, cfg: dict, timeout_s: float = 300.0) -> list[dict]:
    """``world`` fresh ``python -m bench.pipeline MODE JSON`` processes (1 thread each) on a
    TCPStore hosted here on a free port; their JSON results, by rank."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    procs = [H.spawn_child(MODULE, [mode, json.dumps({**cfg, "rank": r, "world": world, "port": store.port})], 1)
             for r in range(world)]
    out = H.collect_children(procs, f"{mode} rank", timeout_s=timeout_s)
    del store
    return sorted(out, key=lambda r: r["rank"])


class Driver:
    """One rank's virtualflow side: its group, a trivial stage group (one pipeline replica) and
    ``drive`` with one :class:`Links` per engine, kept across that engine's steps."""

    def __init__(self, cfg: dict, p: int) -> None:
        import torch.distributed as dist

        from virtualflow.comm.groups import make_group
        from virtualflow.plan.pipeline.geometry import Grid

        torch.set_num_threads(1)
        self.store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=120))
        # As a pipelined job's group: two gloo devices, a connection per direction (make_group's duplex).
        self.group = make_group(self.store, 0, cfg["rank"], cfg["world"], 120.0, CPU, bind=["127.0.0.1"], duplex=True)
        # As a worker's group: an abort flag to read while a receive waits (never raised here), so
        # receives are waited for the way a training job waits for them (links._wait_receive).
        self.group.abort_check = lambda: False
        self.trivial = make_group(self.store, 1, 0, 1, 120.0, CPU)
        self.group2 = None
        if cfg.get("two_devices"):
            # Diagnostic: the same group with one gloo device (one TCP connection per pair of ranks,
            # both directions of a link on it: what pipelined jobs used before duplex groups).
            self.group2 = make_group(self.store, 2, cfg["rank"], cfg["world"], 120.0, CPU, bind=["127.0.0.1"])
            self.group2.abort_check = lambda: False
        self.grid = Grid(p, 1, cfg["rank"])
        self.links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def run(self, engine, first_step: int, n_steps: int = 1, two_devices: bool = False) -> list:
        """``two_devices``: over the diagnostic group (one gloo device; the name is the option's)."""
        from virtualflow.runtime.pipeline.links import Links, drive

        links = self.links.get(engine)
        if links is None:
            links = self.links[engine] = Links()
        return drive(engine.steps(first_step, n_steps), group=self.group2 if two_devices else self.group,
                     stage_group=self.trivial, grid=self.grid, n_pieces=engine.n_pieces, device=CPU, links=links)

    def barrier(self) -> None:
        self.group.all_reduce(torch.zeros(1))

    def close(self) -> None:
        self.group.close()
        if self.group2 is not None:
            self.group2.close()
