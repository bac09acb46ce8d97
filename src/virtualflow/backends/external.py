"""The external backend: workers that someone else starts, anywhere, joining by address.

For clusters without Ray (Slurm, Kubernetes, plain machines): the coordinator's store listens
on ``--listen ADDR:PORT`` and every ``virtualflow worker --join ADDR:PORT --token-file FILE``
(see :mod:`virtualflow.cli.worker`) asks to join. The membership controller sees this backend
through the same ``start_worker`` / ``kill_worker`` / ``poll`` / ``pid`` as the local and Ray
backends, so joins, leaves and failures go through the ordinary generations:

* ``start_worker(id)`` cannot start a process: it opens a *slot* with that id, which the next
  accepted join request fills (the reply carries the id and the job's :class:`WorkerConfig`).
* A join request that finds no open slot asks the controller to grow by one (the ordinary
  resize path; refused when the job already has one worker per virtual node), and takes the
  slot that grow opens.
* A worker that exits or stops beating is found by the controller's heartbeat check; then
  ``kill_worker`` marks it killed here (it is fenced out of later generations by the
  controller; this process cannot kill a process on another machine). A worker that reports
  ``done`` or ``leave`` reads as exited with code 0.

Security: a join request must be signed with the job's token (:mod:`virtualflow.comm.auth`);
others are refused, logged (warning and a ``join_rejected`` event) and change nothing. The
reply is signed too, so a worker only runs a configuration that comes from the holder of the
token (it is a pickle: never unpickled unverified).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import re
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import cloudpickle

from virtualflow.comm import auth

if TYPE_CHECKING:
    from virtualflow.backends import Attachment
    from virtualflow.runtime.worker import WorkerConfig

logger = logging.getLogger(__name__)

JOINS_QUEUE = "vf/joins"
"""Queue of signed join requests (JSON) from ``virtualflow worker --join``."""
_NONCE = re.compile(r"^[0-9a-f]{16,64}$")


def join_reply_key(nonce: str) -> str:
    """Where the coordinator answers the join request with this nonce."""
    return f"vf/join/{nonce}"


def parse_address(text: str, what: str = "--listen") -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[v6]:PORT"`` for IPv6) -> (host, port)."""
    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r} is not ADDR:PORT (e.g. 10.0.0.5:29400, or 0.0.0.0:29400 for every interface)")
    return host, int(port)


def encode_config(config: "WorkerConfig") -> str:
    return base64.b64encode(cloudpickle.dumps(config)).decode("ascii")


def decode_config(text: str) -> "WorkerConfig":
    """Only ever called on a verified (signed) reply."""
    return pickle.loads(base64.b64decode(text))


@dataclass(slots=True)
class ExternalWorker:
    """One slot of the job: the id the controller asked for and who filled it."""

    worker_id: int
    opened: float
    host: str | None = None
    pid_: int | None = None
    code: int | None = None

    @property
    def pid(self) -> int | None:
        return self.pid_

    def log_tail(self, lines: int = 15) -> str:
        if self.host is None:
            return ""
        return f"(worker {self.worker_id} runs on {self.host}, pid {self.pid_}: its output is on that machine's console)"


class ExternalBackend:
    """Workers started elsewhere that join by address (see the module docstring)."""

    name = "external"
    kind_of_worker = "external workers"

    def __init__(self, listen: tuple[str, int]) -> None:
        self.listen = listen
        self.workers: dict[int, ExternalWorker] = {}
        self._open: list[int] = []
        self._waiting: deque[dict[str, Any]] = deque()
        self._guard = auth.ReplayGuard()

    def store_address(self) -> tuple[str, int]:
        return self.listen

    def default_threads(self, workers: int) -> int:
        return max(1, (os.cpu_count() or 1) // workers)

    def check_capacity(self, workers: int, *, knob: str = "--workers") -> None:
        return None  # whoever starts the workers decides

    def attach(self, attachment: "Attachment") -> None:
        self.config = attachment.config
        self.store = attachment.store
        self.token = attachment.token
        self.grow = attachment.grow
        self.event = attachment.event
        self._config_text = encode_config(self.config)

    def log_tail(self, worker_id: int, lines: int = 15) -> str:
        w = self.workers.get(worker_id)
        return w.log_tail(lines) if w is not None else ""

    # -- the launcher interface of the membership controller --------------------------------
    def start_worker(self, worker_id: int) -> ExternalWorker:
        w = ExternalWorker(worker_id, time.monotonic())
        self.workers[worker_id] = w
        self._open.append(worker_id)
        self._assign()
        return w

    def kill_worker(self, worker_id: int) -> None:
        w = self.workers.get(worker_id)
        if w is None or w.code is not None:
            return
        w.code = -int(signal.SIGKILL)
        if worker_id in self._open:
            self._open.remove(worker_id)
        logger.warning("worker %d (%s, pid %s) is fenced out of the job; this coordinator cannot kill it, stop it "
                       "on its machine", worker_id, w.host, w.pid_)

    def pid(self, worker_id: int) -> int | None:
        w = self.workers.get(worker_id)
        return w.pid_ if w is not None else None

    def poll(self) -> dict[int, int | None]:
        return {wid: w.code for wid, w in self.workers.items()}

    def terminate_all(self, grace_s: float = 3.0) -> None:
        """Remote workers exit on their own once the job's store closes; mark them ended."""
        for w in self.workers.values():
            if w.code is None:
                w.code = -int(signal.SIGTERM)
        self._open.clear()
        for req in self._waiting:
            self._reply(req["nonce"], {"rejected": "the job has ended"})
        self._waiting.clear()

    # -- joins -------------------------------------------------------------------------------
    def serve(self, reports: Sequence[dict[str, Any]]) -> None:
        """Called by the job's monitor every tick: note workers that finished, answer joins."""
        for r in reports:
            if r.get("type") in ("done", "leave"):
                w = self.workers.get(r.get("worker"))
                if w is not None and w.code is None:
                    w.code = 0
        n = self.store.queue_len(JOINS_QUEUE)
        for _ in range(min(n, 100)):
            raw = self.store.queue_pop(JOINS_QUEUE, block=False)
            self._on_join_request(raw)
        self._assign()

    def _on_join_request(self, raw: bytes | str) -> None:
        try:
            message = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            message = None
        claimed = message.get("payload", {}) if isinstance(message, dict) else {}
        claimed = claimed if isinstance(claimed, dict) else {}
        try:
            payload = auth.verify(self.token, message, guard=self._guard)
            if payload.get("op") != "join":
                raise auth.AuthError(f"not a join request (op={payload.get('op')!r})")
        except auth.AuthError as exc:
            host, pid = str(claimed.get("host"))[:100], claimed.get("pid")
            logger.warning("rejected a join request (claims host %s, pid %s): %s", host, pid, exc)
            self.event("join_rejected", host=host, pid=pid, reason=str(exc))
            nonce = claimed.get("nonce")
            # Answer a misconfigured worker, but never overwrite an answer (a replayed request).
            if isinstance(nonce, str) and _NONCE.match(nonce) and not self.store.check([join_reply_key(nonce)]):
                self._reply(nonce, {"rejected": str(exc)})
            return
        if not _NONCE.match(payload["nonce"]):
            return
        self.event("join_request", host=payload.get("host"), pid=payload.get("pid"))
        req = {"nonce": payload["nonce"], "host": str(payload.get("host")), "pid": payload.get("pid"),
               "asked": False}
        self._waiting.append(req)

    def _assign(self) -> None:
        """Fill open slots with waiting joiners (lowest id first); ask to grow for the rest."""
        self._open.sort()
        while self._open and self._waiting:
            wid, req = self._open.pop(0), self._waiting.popleft()
            w = self.workers[wid]
            w.host, w.pid_ = req["host"], req["pid"]
            reply = auth.sign(self.token, {"op": "welcome", "worker": wid, "request": req["nonce"],
                                           "config": self._config_text})
            self._reply(req["nonce"], reply)
            self.event("joined", worker=wid, host=w.host, pid=w.pid_)
            logger.info("worker %d joined from %s (pid %s)", wid, w.host, w.pid_)
        for req in list(self._waiting):
            if req["asked"]:
                continue
            req["asked"] = True
            why = self.grow()
            if why is not None:
                self._waiting.remove(req)
                logger.warning("refused a join from %s (pid %s): %s", req["host"], req["pid"], why)
                self.event("join_refused", host=req["host"], pid=req["pid"], reason=why)
                self._reply(req["nonce"], {"rejected": why})

    def _reply(self, nonce: str, message: dict[str, Any]) -> None:
        self.store.set(join_reply_key(nonce), json.dumps(message))
