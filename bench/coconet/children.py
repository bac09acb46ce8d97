"""What the child processes share: the store client and :func:`launch_pair` (two ranks as
``python -m bench.coconet --child-... JSON`` in fresh interpreters, their JSON results).
"""

from __future__ import annotations

import datetime
import json

from bench import harness as H
from bench.coconet.workload import MODULE, WORLD


# --------------------------------------------------------------------------------------------
# Shared by the children.


def store_client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, WORLD, False, timeout=datetime.timedelta(seconds=120))


def launch_pair(flag: str, cfg: dict, timeout_s: float = 400.0) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    procs = [H.spawn_child(MODULE, [flag, json.dumps({**cfg, "rank": r, "port": store.port})], 1)
             for r in range(WORLD)]
    out = H.collect_children(procs, f"{flag} rank", timeout_s=timeout_s)
    del store
    return sorted(out, key=lambda r: r["rank"])
