"""``virtualflow resize RUN_DIR --workers N``: change a running job's worker count in place.

The request goes to the job's coordinator through its store (loopback only in local mode) and
takes effect at the next step boundary. It is signed with the run's token (``RUN_DIR/token``, or
the token file the job was started with) for the run's job id (from ``status.json``): the
coordinator ignores unsigned requests, and a request for one run verifies in no other, even one
that shares the token file. A finished run, or one whose coordinator is gone, is refused.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

from virtualflow.records.rundir import read_status, run_state
from virtualflow.control.membership import check_resize


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("resize", help="change a running job's number of workers",
                       description="Ask a running job to grow or shrink; it changes at the next step boundary, "
                       "without a restart.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--workers", type=int, required=True, help="new number of workers")
    p.add_argument("--wait", action="store_true", help="wait until the new generation has formed")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS", help="with --wait (default 120)")
    p.add_argument("--token-file", metavar="FILE",
                   help="the job's token (default: the token file named in RUN_DIR/status.json, else RUN_DIR/token)")
    p.set_defaults(func=main)


def token_path(run_dir: str, status: dict) -> str:
    return status.get("coordinator", {}).get("token_file") or os.path.join(run_dir, "token")


def request_resize(run_dir: str, workers: int, token_file: str | None = None) -> dict:
    import torch.distributed as dist

    from virtualflow.comm import auth, protocol

    status = read_status(run_dir)
    state = run_state(run_dir, status)
    if state == "finished":
        raise ValueError(f"the run in {run_dir!r} has finished ({status.get('state')}); there is nothing to resize")
    if state == "orphaned":
        raise ValueError(f"the run in {run_dir!r} has no live coordinator (pid {status['coordinator']['pid']} is gone); "
                         f"continue it with `virtualflow run JOB --resume {run_dir}`")
    stages = status.get("replica_workers", status.get("pipeline_stages"))  # whole replicas: stages x tensor
    check_resize(workers, int(status["virtual_nodes"]), int(status.get("min_workers", 1)),
                 int(stages) if isinstance(stages, int) and not isinstance(stages, bool) and stages > 0 else None)
    job_id = status.get("job_id")
    if not auth.is_job_id(job_id):
        raise ValueError(f"{os.path.join(run_dir, 'status.json')} names no job id (a run started by an older "
                         f"virtualflow?): resize it from the process that launched it")
    coord = status["coordinator"]
    store = dist.TCPStore(coord["host"], int(coord["port"]), is_master=False,
                          timeout=datetime.timedelta(seconds=10))
    token = auth.read_token(token_file or token_path(run_dir, status), private=True)
    message = auth.sign(token, {"op": "resize", "workers": workers, "source": "cli"}, job=job_id, kind="request")
    store.queue_push(protocol.REQUESTS_QUEUE, message)
    status["request_nonce"] = auth.payload_of(message)["nonce"]
    return status


def main(args: argparse.Namespace) -> int:
    before = request_resize(args.run_dir, args.workers, args.token_file)
    print(f"requested: {len(before.get('workers', []))} -> {args.workers} workers "
          f"(takes effect at the next step boundary)")
    if args.wait:
        deadline = time.monotonic() + args.timeout
        unreadable = ""
        while time.monotonic() < deadline:
            try:
                st = read_status(args.run_dir)
            except ValueError as exc:
                # Caught while the launcher rewrites it: the next poll sees the new file.
                unreadable = f" (last read: {exc})"
                time.sleep(0.2)
                continue
            unreadable = ""
            members = [w for w in st.get("workers", []) if w.get("rank") is not None]
            # A status written before the coordinator took this request says nothing about it
            # (it may show the requested size from an earlier state of the job).
            taken = before["request_nonce"] in st.get("taken_requests", [])
            if taken and st.get("generation") == st.get("formed_generation") and len(members) == args.workers:
                print(f"generation {st['generation']} formed with {args.workers} workers at step {st['step']}")
                return 0
            if run_state(args.run_dir, st) != "running":
                print(f"the run ended ({st.get('state')}) before the resize completed")
                return 1
            time.sleep(0.2)
        print(f"not done after {args.timeout:g} s; see `virtualflow status {args.run_dir}`{unreadable}")
        return 1
    return 0
