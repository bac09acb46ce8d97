"""``virtualflow resize --wait`` judges only a status written after its request was taken.

No job runs here: the test plays the coordinator (a TCPStore and the run directory's
``status.json``), so it can write exactly the stale status that fooled the command before: one
that already shows the requested size, from before the request was taken.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time

import torch.distributed as dist

from virtualflow.cli.main import main
from virtualflow.comm import auth, protocol


JOB = "0123456789abcdef"


def write_status(run_dir: str, store: dist.TCPStore, workers: int, taken: list[str]) -> None:
    status = {
        "job_id": JOB, "state": "running", "step": 5, "generation": 1, "formed_generation": 1, "virtual_nodes": 8,
        "min_workers": 1, "target_workers": workers, "taken_requests": taken,
        "workers": [{"id": i, "rank": i, "pid": os.getpid(), "vns": []} for i in range(workers)],
        "coordinator": {"host": "127.0.0.1", "port": store.port, "pid": os.getpid(),
                        "token_file": os.path.join(run_dir, "token")},
    }
    tmp = os.path.join(run_dir, ".status.tmp")
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, os.path.join(run_dir, "status.json"))


def test_wait_ignores_a_status_from_before_the_request_was_taken(tmp_path, capsys):
    run_dir = str(tmp_path)
    token = auth.new_token()
    auth.write_token(os.path.join(run_dir, "token"), token)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    # Stale: the job already shows 2 workers (say, a grow to 2 just formed) but the coordinator
    # has not taken the request to resize to 2 yet; it never does in this first call.
    write_status(run_dir, store, workers=2, taken=[])
    assert main(["resize", run_dir, "--workers", "2", "--wait", "--timeout", "1"]) == 1
    assert "not done after 1 s" in capsys.readouterr().out

    # Now a coordinator takes the request (checking its signature) and then reports the size.
    def coordinator() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for message in protocol.pop_raw(store, protocol.REQUESTS_QUEUE):
                req = protocol.parse_request(token, JOB, message, None)  # signed for this job's id
                if req["workers"] == 2:
                    time.sleep(0.5)  # the request is taken a little later than it is sent
                    write_status(run_dir, store, workers=2, taken=[req["nonce"]])
                    return
            time.sleep(0.05)

    store.queue_pop(protocol.REQUESTS_QUEUE, block=False)  # the first call's request, never taken
    t = threading.Thread(target=coordinator)
    t.start()
    t0 = time.monotonic()
    assert main(["resize", run_dir, "--workers", "2", "--wait", "--timeout", "10"]) == 0
    assert time.monotonic() - t0 >= 0.4  # it waited for the take, not for the stale status
    assert "formed with 2 workers" in capsys.readouterr().out
    t.join()
