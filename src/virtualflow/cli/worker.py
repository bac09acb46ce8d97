"""``virtualflow worker --join ADDR:PORT --token-file FILE``: join a job started with
``virtualflow run JOB --backend external --listen ADDR:PORT`` and train in it until it ends.

The worker connects to the job's store, reads the job id (``vf/job``), pushes a join request
signed with the job's token for that job (HMAC-SHA256 over the request, with a nonce and a time:
:mod:`virtualflow.comm.auth`) and waits for the coordinator's answer, which is signed too: its
worker id and the job's configuration. An answer that does not verify is refused (the
configuration is never unpickled unverified). The configuration comes without the run key (it
travelled through the store); the worker derives the key from its token and the job id. Then it
runs :func:`virtualflow.runtime.worker.run_worker`, the same loop as a local worker's.
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
    p.add_argument("--interface", metavar="auto|IFACE|ADDR",
                   help="what this worker's collectives (gloo) bind to and tell their peers: auto (the address "
                   "that reaches the coordinator), an interface name such as eth0, or an address of this machine "
                   "(default: the job's --interface; with the job's auto, GLOO_SOCKET_IFNAME when set here)")
    p.set_defaults(func=main)


class JoinRefused(RuntimeError):
    """The coordinator refused the join, or its answer does not verify."""


def join(address: str, token: str, timeout_s: float = 120.0) -> tuple[int, object]:
    """Ask the coordinator at ``address`` for a place in its job; returns (worker id, WorkerConfig)."""
    import torch.distributed as dist

    from virtualflow.backends.external import JOINS_QUEUE, decode_config, join_reply_key, parse_address
    from virtualflow.comm import auth, protocol
    from virtualflow.comm.rejects import short

    host, port = parse_address(address, "--join")
    deadline = time.monotonic() + timeout_s
    _wait_for_listener(address, host, port, deadline)
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=min(timeout_s, 60.0)))
    while not store.check([protocol.JOB_KEY]):
        if time.monotonic() > deadline:
            raise JoinRefused(f"{address} holds no virtualflow job (no job id in its store)")
        time.sleep(0.05)
    job_id = store.get(protocol.JOB_KEY).decode("ascii", "replace")
    if not auth.is_job_id(job_id):
        raise JoinRefused(f"the job id in the store at {address} is not one: {short(job_id, 40)!r}")
    request = auth.sign(token, {"op": "join", "host": socket.gethostname(), "pid": os.getpid()}, job=job_id,
                        kind="join")
    nonce = auth.payload_of(request)["nonce"]
    store.queue_push(JOINS_QUEUE, request)
    key = join_reply_key(nonce)
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise JoinRefused(f"the coordinator at {address} did not answer the join request within {timeout_s:g} s")
        time.sleep(0.05)
    raw = store.get(key)
    store.delete_key(key)
    try:
        payload = protocol.parse_welcome(token, job_id, raw, nonce)
    except ValueError as exc:
        refusal = _refusal(raw)
        if refusal is not None:
            raise JoinRefused(f"the coordinator at {address} refused the join: {short(refusal)}") from None
        raise JoinRefused(f"the answer from {address} does not verify with this token: {exc}") from None
    config = decode_config(payload["config"])
    if getattr(config, "job_id", None) != job_id:
        raise JoinRefused(f"the configuration from {address} is for another job")
    # The coordinator may listen on 0.0.0.0: reach it where this worker reached it. The run key
    # never travels through the store: derive it from the token.
    config = dataclasses.replace(config, store_host=host, store_port=port, run_key=auth.run_key(token, job_id))
    return payload["worker"], config


def _wait_for_listener(address: str, host: str, port: int, deadline: float) -> None:
    """Retry a plain TCP connection until something listens at ``address`` (the coordinator may
    start later), so that nobody listening is one clear error instead of the store's retries."""
    last: OSError | None = None
    while True:
        try:
            socket.create_connection((host, port), timeout=2.0).close()
            return
        except OSError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise JoinRefused(f"nothing is listening at {address} ({last.strerror or last}); start the job first "
                              f"(virtualflow run ... --backend external --listen {address}) or check --join")
        time.sleep(0.5)


def _refusal(raw: bytes) -> str | None:
    """The reason of an (unsigned) refusal, ``{"rejected": REASON}``; None if ``raw`` is not one."""
    try:
        answer = json.loads(raw) if len(raw) < 4096 else None
    except (ValueError, RecursionError):
        return None
    if isinstance(answer, dict) and isinstance(answer.get("rejected"), str):
        return answer["rejected"]
    return None


def main(args: argparse.Namespace) -> int:
    from virtualflow.backends.external import parse_address
    from virtualflow.comm import auth
    from virtualflow.comm.net import resolve_interface

    if args.interface is not None:  # before joining: a worker that cannot start takes no place
        resolve_interface(args.interface, *parse_address(args.join, "--join"), knob="virtualflow worker --interface")
    token = auth.read_token(args.token_file, private=True)
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
    from virtualflow.backends.local_worker import interface_from_environment

    if args.interface is not None:
        config = dataclasses.replace(config, interface=args.interface, interface_knob="virtualflow worker --interface")
    else:
        config = interface_from_environment(config)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be at least 1")
        config = dataclasses.replace(config, threads=args.threads)
    print(f"joined {args.join} as worker {worker_id} ({config.threads} thread{'s' if config.threads > 1 else ''})",
          flush=True)
    from virtualflow.backends.local_worker import preemption_notice
    from virtualflow.backends.inprocess import eager_every_wait_from_env
    from virtualflow.runtime.worker import run_worker

    from virtualflow.backends.descendants import end_descendants, keep_descendants

    keep_descendants()  # what the job starts stays in this tree, and ends with this worker
    # SIGTERM while training (a spot machine's notice) releases this worker at a step boundary
    try:
        code = run_worker(config, worker_id, preemption_notice(), eager_every_wait=eager_every_wait_from_env())
    finally:
        end_descendants()
    sys.stdout.flush()
    sys.stderr.flush()
    # As a local worker: skip interpreter teardown (gloo threads can abort it); all is reported.
    os._exit(code)
