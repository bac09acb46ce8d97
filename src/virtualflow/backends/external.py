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
* A welcomed worker beats from the start of its set-up. One that dies or freezes after its
  welcome but before it reports ``join`` (the controller watches heartbeats from ``join`` on)
  is judged here (:class:`WelcomeWatch`): no first beat within ``first_beat_s`` of the welcome,
  or silent for ``silence_s`` after beating, and it reads as killed, with that cause; the
  controller handles it as a failed worker (fenced), so the generation waiting for it is
  re-formed without it and joiners queued behind it are asked for again.
* A worker that exits or stops beating is found by the controller's heartbeat check; then
  ``kill_worker`` marks it killed here (it is fenced out of later generations by the
  controller; this process cannot kill a process on another machine). A worker that reports
  ``done`` or ``leave`` reads as exited with code 0.

Security: a join request must be signed with the job's token for this job's id (read from the
store's ``vf/job``), fresh and never seen before (:mod:`virtualflow.comm.auth`); others are
refused, logged (a warning and a ``join_rejected`` event, every field cut short and at most 30 a
minute: :class:`~virtualflow.comm.rejects.RejectLog`) and change nothing. A refused request that
names a sensible nonce gets a short refusal at ``vf/join/<nonce>`` (so a misconfigured worker
learns why at once), but never over an answer already given, at most
:data:`MAX_REFUSALS` at a time, each deleted after :data:`REFUSAL_TTL_S`. The reply to an accepted
join is signed too, so a worker only runs a configuration that comes from the holder of the
token (it is a pickle: never unpickled unverified). The configuration sent carries the job id
but not the run key (the store is not private): the worker derives that from its token file.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import pickle
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import cloudpickle

from virtualflow.comm import auth, protocol
from virtualflow.config.network import parse_listen
from virtualflow.comm.rejects import RejectLog, short

if TYPE_CHECKING:
    from virtualflow.backends.base import Attachment
    from virtualflow.runtime.worker import WorkerConfig

logger = logging.getLogger(__name__)

JOINS_QUEUE = "vf/joins"
"""Queue of signed join requests from ``virtualflow worker --join``."""
MAX_REFUSALS = 32
"""Refusal answers (``vf/join/<nonce>``) that may wait in the store at once; beyond that a refused
request gets none (its worker times out instead)."""
REFUSAL_TTL_S = 60.0
"""A refusal answer nobody has read is deleted after this long."""


def join_reply_key(nonce: str) -> str:
    """Where the coordinator answers the join request with this nonce."""
    return f"vf/join/{nonce}"


def parse_address(text: str, what: str = "--listen") -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[v6]:PORT"`` for IPv6) -> (host, port)."""
    return parse_listen(text, what)


def encode_config(config: "WorkerConfig") -> str:
    """The configuration a joining worker receives, without the run key (see the module docstring)."""
    return base64.b64encode(cloudpickle.dumps(dataclasses.replace(config, run_key=""))).decode("ascii")


def decode_config(text: str) -> "WorkerConfig":
    """Only ever called on a verified (signed) reply."""
    return pickle.loads(base64.b64decode(text))


FENCED = "fenced out (this coordinator cannot stop a process on another machine: stop it there)"
"""What :meth:`ExternalBackend.kill_worker` does, in words."""


class WelcomeWatch:
    """Welcomed workers that have not reported ``join`` yet, judged by their heartbeats (pure:
    the times and heartbeat counts are passed in).

    Invariants: a worker is judged once (it leaves the watch when judged or joined); a worker
    that has never beaten is silent after ``first_beat_s``, one that has after ``silence_s``
    without a new beat."""

    def __init__(self, *, first_beat_s: float, silence_s: float) -> None:
        self.first_beat_s, self.silence_s = first_beat_s, silence_s
        self._watched: dict[int, tuple[float, int | None]] = {}  # worker -> (last change, last count)

    def welcomed(self, worker: int, now: float) -> None:
        self._watched[worker] = (now, None)

    def joined(self, worker: int) -> None:
        self._watched.pop(worker, None)

    @property
    def watched(self) -> list[int]:
        return list(self._watched)

    def judge(self, counts: dict[int, int], now: float) -> dict[int, str]:
        """``counts``: each watched worker's heartbeat counter now. Returns the silent ones with
        their causes (and stops watching them)."""
        silent: dict[int, str] = {}
        for w, (since, last) in list(self._watched.items()):
            count = counts.get(w, 0)
            if count != (last if last is not None else 0):
                self._watched[w] = (now, count)
                continue
            if last is None and now - since > self.first_beat_s:
                silent[w] = (f"was welcomed but never started beating (no heartbeat within {self.first_beat_s:g} s "
                             f"of its welcome; it died or froze before its set-up); fenced out")
            elif last is not None and now - since > self.silence_s:
                silent[w] = (f"was welcomed, then went silent during its set-up (no heartbeat for {now - since:.1f} s, "
                             f"before it joined); fenced out")
        for w in silent:
            del self._watched[w]
        return silent


@dataclass(slots=True)
class ExternalWorker:
    """One slot of the job: the id the controller asked for and who filled it."""

    worker_id: int
    opened: float
    host: str | None = None
    pid_: int | None = None
    code: int | None = None
    cause: str | None = None
    """Why it reads as killed when this backend judged it (silent after its welcome)."""

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

    def __init__(self, listen: tuple[str, int], *, clock: Callable[[], float] = time.monotonic,
                 silence_s: float = 3.0, first_beat_s: float | None = None) -> None:
        self.listen = listen
        self.clock = clock
        first = first_beat_s if first_beat_s is not None else max(30.0, 10 * silence_s)
        self.welcome = WelcomeWatch(first_beat_s=first, silence_s=silence_s)
        """Welcomed workers that have not joined (see the module docstring)."""
        self.workers: dict[int, ExternalWorker] = {}
        self._open: list[int] = []
        self._waiting: deque[dict[str, Any]] = deque()
        self._guard = auth.ReplayGuard()
        self.refusals: deque[tuple[float, str]] = deque()
        """Refusal answers waiting in the store: (when to delete, key)."""

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
        self.job_id = attachment.config.job_id
        self.rejects = RejectLog(attachment.event, logger)
        self.config_text = encode_config(self.config)
        """What a welcome carries: the workers' configuration with no key in it."""

    def logs_where(self) -> str:
        return "each external worker's output is on the console of the machine it runs on"

    def log_tail(self, worker_id: int, lines: int = 15) -> str:
        w = self.workers.get(worker_id)
        return w.log_tail(lines) if w is not None else ""

    # -- the launcher interface of the membership controller --------------------------------
    def start_worker(self, worker_id: int) -> ExternalWorker:
        w = ExternalWorker(worker_id, self.clock())
        self.workers[worker_id] = w
        self._open.append(worker_id)
        self._assign()
        return w

    def kill_worker(self, worker_id: int) -> str:
        """Fence one worker out: its process runs on another machine, which this one cannot stop
        (the controller refuses its reports and points it to ``fail``)."""
        what = FENCED
        w = self.workers.get(worker_id)
        if w is None or w.code is not None:
            return what
        w.code = -int(signal.SIGKILL)
        if worker_id in self._open:
            self._open.remove(worker_id)
        logger.warning("worker %d (%s, pid %s) is fenced out of the job; this coordinator cannot kill it, stop it "
                       "on its machine", worker_id, w.host, w.pid_)
        return what

    def pid(self, worker_id: int) -> int | None:
        w = self.workers.get(worker_id)
        return w.pid_ if w is not None else None

    def exit_cause(self, worker_id: int) -> str | None:
        """Why a worker this backend judged reads as killed (None: not judged here)."""
        w = self.workers.get(worker_id)
        return w.cause if w is not None else None

    def poll(self) -> dict[int, int | None]:
        return {wid: w.code for wid, w in self.workers.items()}

    def terminate_all(self, grace_s: float = 3.0) -> None:
        """Remote workers exit on their own once the job's store closes; mark them ended."""
        for w in self.workers.values():
            if w.code is None:
                w.code = -int(signal.SIGTERM)
        self._open.clear()
        for req in self._waiting:
            self._refuse(req["nonce"], "the job has ended")
        self._waiting.clear()
        self.rejects.flush()

    # -- joins -------------------------------------------------------------------------------
    def serve(self, reports: Sequence[dict[str, Any]]) -> None:
        """Called by the job's monitor every tick: note workers that finished, answer joins."""
        for r in reports:
            if r.get("type") == "join":
                self.welcome.joined(r.get("worker"))
            if r.get("type") in ("done", "leave"):
                w = self.workers.get(r.get("worker"))
                if w is not None and w.code is None:
                    w.code = 0
        now = self.clock()
        self._judge_welcomed(now)
        while self.refusals and self.refusals[0][0] <= now:
            key = self.refusals.popleft()[1]
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - gone already (the worker read and deleted it)
                pass
        for raw in protocol.pop_raw(self.store, JOINS_QUEUE, limit=100):
            self._on_join_request(raw)
        self._assign()

    def _judge_welcomed(self, now: float) -> None:
        watched = [w for w in self.welcome.watched if self.workers[w].code is None]
        if not watched:
            return
        counts = {w: self.store.add(protocol.heartbeat_key(w), 0) for w in watched}
        for wid, cause in self.welcome.judge(counts, now).items():
            w = self.workers[wid]
            w.code, w.cause = -int(signal.SIGKILL), cause
            logger.warning("worker %d (%s, pid %s) %s", wid, w.host, w.pid_, cause)
            self.event("welcome_expired", worker=wid, host=w.host, pid=w.pid_, cause=cause)
            # The controller re-forms without it and, without replace_failed, shrinks its target:
            # a grow asked for a joiner queued meanwhile may be gone with it, so ask again.
            for req in self._waiting:
                req["asked"] = False

    def _on_join_request(self, raw: bytes) -> None:
        try:
            payload = protocol.parse_join(self.token, self.job_id, raw, self._guard)
        except ValueError as exc:
            claimed = protocol.claims(raw)
            self.rejects("join_rejected", exc, raw, host=claimed.get("host"), pid=claimed.get("pid"))
            nonce = claimed.get("nonce")
            # Answer a misconfigured worker, but never overwrite an answer (a replayed request).
            if nonce is not None and not self.store.check([join_reply_key(nonce)]):
                self._refuse(nonce, str(exc))
            return
        host = short(payload["host"], 100)
        self.event("join_request", host=host, pid=payload["pid"])
        self._waiting.append({"nonce": payload["nonce"], "host": host, "pid": payload["pid"], "asked": False})

    def _assign(self) -> None:
        """Fill open slots with waiting joiners (lowest id first); ask to grow for the rest."""
        self._open.sort()
        while self._open and self._waiting:
            wid, req = self._open.pop(0), self._waiting.popleft()
            w = self.workers[wid]
            w.host, w.pid_ = req["host"], req["pid"]
            reply = auth.sign(self.token, {"op": "welcome", "worker": wid, "request": req["nonce"],
                                           "config": self.config_text}, job=self.job_id, kind="welcome")
            self.store.set(join_reply_key(req["nonce"]), reply)
            self.welcome.welcomed(wid, self.clock())
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
                self._refuse(req["nonce"], why)

    def _refuse(self, nonce: str, why: str) -> None:
        """Answer a join with a refusal (unsigned: it only tells a worker to give up), if fewer than
        :data:`MAX_REFUSALS` are waiting; deleted after :data:`REFUSAL_TTL_S` if nobody reads it."""
        if len(self.refusals) >= MAX_REFUSALS:
            return
        key = join_reply_key(nonce)
        self.store.set(key, json.dumps({"rejected": short(why)}))
        self.refusals.append((self.clock() + REFUSAL_TTL_S, key))
