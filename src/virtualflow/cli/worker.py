"""``virtualflow worker --join ADDR:PORT --token-file FILE``: join a job started with
``virtualflow run JOB --backend external --listen ADDR:PORT`` and train in it until it ends.

The worker connects to the job's store, pushes a join request signed with the job's token
(HMAC-SHA256 over the request, with a nonce and a time: :mod:`virtualflow.comm.auth`) and waits
for the coordinator's answer, which is signed too: its worker id and the job's configuration.
An answer that does not verify is refused (the configuration is never unpickled unverified).
Then it runs :func:`virtualflow.runtime.worker.run_worker`, the same loop as a local worker's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import sys
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="join a job started with --backend external",
                       description="Join a running job's coordinator (virtualflow run JOB --backend external --listen "
                       "ADDR:PORT) and train in it; the job may be joined and left at any time.")
    p.add_argument("--join", required=True, metavar="ADDR:PORT", help="the coordinator's --listen address")
    p.add_argument("--token-file", required=True, metavar="FILE",
                   help="the job's token (the coordinator's RUN_DIR/token or its --token-file), mode 0600")
    p.add_argument("--join-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="give up when the coordinator has not answered after this long (default 120)")
    p.add_argument("--threads", type=int, metavar="T",
                   help="torch threads for this worker (default: the job's --threads-per-worker, which the "
                   "coordinator derived from its own machine unless given)")
    p.set_defaults(func=main)


class JoinRefused(RuntimeError):
    """The coordinator refused the join, or its answer does not verify."""


def join(address: str, token: str, timeout_s: float = 120.0) -> tuple[int, object]:
    """Ask the coordinator at ``address`` for a place in its job; returns (worker id, WorkerConfig)."""
    import torch.distributed as dist

    from virtualflow.backends.external import JOINS_QUEUE, decode_config, join_reply_key, parse_address
    from virtualflow.comm import auth

    host, port = parse_address(address, "--join")
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=min(timeout_s, 60.0)))
    request = auth.sign(token, {"op": "join", "host": socket.gethostname(), "pid": os.getpid()})
    nonce = request["payload"]["nonce"]
    store.queue_push(JOINS_QUEUE, json.dumps(request))
    key = join_reply_key(nonce)
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise JoinRefused(f"the coordinator at {address} did not answer the join request within {timeout_s:g} s")
        time.sleep(0.05)
    answer = json.loads(store.get(key))
    store.delete_key(key)
    if isinstance(answer, dict) and "rejected" in answer:
        raise JoinRefused(f"the coordinator at {address} refused the join: {answer['rejected']}")
    try:
        payload = auth.verify(token, answer)
    except auth.AuthError as exc:
        raise JoinRefused(f"the answer from {address} does not verify with this token: {exc}") from None
    if payload.get("op") != "welcome" or payload.get("request") != nonce:
        raise JoinRefused(f"the answer from {address} is not for this join request")
    config = decode_config(payload["config"])
    # The coordinator may listen on 0.0.0.0: reach it where this worker reached it.
    config = dataclasses.replace(config, store_host=host, store_port=port)
    return int(payload["worker"]), config


def main(args: argparse.Namespace) -> int:
    from virtualflow.comm import auth

    token = auth.read_token(args.token_file)
    if not auth.token_file_is_private(args.token_file):
        print(f"virtualflow worker: warning: {args.token_file} is readable by other users; chmod 600 it",
              file=sys.stderr)
    try:
        worker_id, config = join(args.join, token, args.join_timeout)
    except JoinRefused as exc:
        print(f"virtualflow worker: {exc}", file=sys.stderr)
        return 1
    if not os.path.isdir(config.state_dir):
        print(f"virtualflow worker: the job's run directory {config.state_dir} is not visible on this machine; "
              f"external workers need it on a filesystem they share with the coordinator (same path)",
              file=sys.stderr)
        return 1
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be at least 1")
        config = dataclasses.replace(config, threads=args.threads)
    print(f"joined {args.join} as worker {worker_id} ({config.threads} thread{'s' if config.threads > 1 else ''})",
          flush=True)
    from virtualflow.runtime.worker import run_worker

    code = run_worker(config, worker_id)
    sys.stdout.flush()
    sys.stderr.flush()
    # As a local worker: skip interpreter teardown (gloo threads can abort it); all is reported.
    os._exit(code)
