"""The keys and messages coordinator and workers exchange through the job's TCPStore, and the
one place where what is read from the store is checked.

Control plane only; tensors travel over process groups. Keys:

* ``vf/job``                   the job id of this launch (hex; public, not a secret)
* ``vf/generation``            number of the latest membership generation (decimal string)
* ``vf/gen/<g>``               signed :class:`GenerationRecord` of generation ``g``
* ``vf/control/seq``           number of the latest control command (0: none; a plain counter)
* ``vf/control/<n>``           signed command ``n`` (``stop``, ``regroup``, ``slowdown``, ``batch``)
* ``vf/member/<w>/next/<g>``   signed: where worker ``w`` goes after generation ``g`` ends
                               (planned or broken): the next generation number, or
                               ``leave <g'>``/``fail``. ``g = -1`` is a newcomer's entry point.
* ``vf/gen/<g>/arrived``       counter: members that reached generation ``g``'s rendezvous
* ``vf/gen/<g>/abort``         signed flag: generation ``g`` is broken (a member died or hung)
* ``vf/gen/<g>/formed``        set by rank 0 once generation ``g``'s group and state are ready
* ``vf/hb/<w>``                worker ``w``'s heartbeat counter (incremented by a thread)
* ``vf/recorded``              steps the coordinator has recorded so far (a plain counter): rank 0
                               keeps the newest checkpoint these reach when it prunes (a forged
                               value can only make it keep one file more, or one fewer)
* queue ``vf/reports``         signed messages from workers (join, arrived, formed, step, fault,
                               leave, held, checkpoint, eval, error, done, notice, rejected)
* queue ``vf/requests``        signed requests from outside the job (``virtualflow resize``)

Process groups of generation ``g`` live under ``PrefixStore(f"gen/{g}", store)``, a namespace
no key above can collide with.

Invariants of every read (the ``parse_*`` functions; nothing else parses what the store holds):

* a raw message over its channel's size limit is refused before it is looked at;
* its signature is checked over the raw bytes before anything is parsed
  (:mod:`virtualflow.comm.auth`), with the key of its channel: the job's token for requests,
  joins and join answers, the run key for everything the run's processes write;
* the verified payload must be of the channel's kind and job, and bound to where it was read
  (a command to its sequence number, a record to its generation, a next pointer to its worker
  and generation, a report to a sequence number above its worker's last one), so a valid
  message copied to another key or queued again does not verify;
* its fields are checked against the small explicit schemas below (types, bounded sizes;
  unknown extra fields are ignored).

Each raises :class:`BadMessage` (a ``ValueError``; :class:`~virtualflow.comm.auth.AuthError` is
one too) and nothing else: the reader drops the message and logs it
(:class:`virtualflow.comm.rejects.RejectLog`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from virtualflow.comm import auth

JOB_KEY = "vf/job"
GENERATION_KEY = "vf/generation"
CONTROL_SEQ_KEY = "vf/control/seq"
RECORDED_KEY = "vf/recorded"
REPORTS_QUEUE = "vf/reports"
REQUESTS_QUEUE = "vf/requests"
LEAVE = "leave"
FAIL = "fail"

# Size limits per channel (raw bytes), checked before anything else.
MAX_REPORT_BYTES = 256 * 1024
"""A step report of a job with thousands of VNs, or an error with its (truncated) traceback."""
MAX_REQUEST_BYTES = 16 * 1024
MAX_JOIN_BYTES = 16 * 1024
MAX_CONTROL_BYTES = 16 * 1024
"""Commands, next pointers and abort flags."""
MAX_RECORD_BYTES = 4 * 1024 * 1024
"""A generation record: members and their VN lists."""
MAX_WELCOME_BYTES = 512 * 1024 * 1024
"""A join answer carries the job's configuration (the job's code, pickled)."""

MAX_TEXT = 64 * 1024
"""Longest string field of any message."""
MAX_ITEMS = 1 << 20
"""Most items of any list or map field."""

_SEQ = re.compile(rb"\d{1,18}")
_NONCE = re.compile(r"[0-9a-f]{16,64}")
_NEXT = re.compile(r"(\d{1,18})|leave \d{1,18}|fail")


class BadMessage(ValueError):
    """A message read from the store was refused: unsigned, wrongly signed, out of place, or not
    of its schema. The message says why."""


def generation_key(g: int) -> str:
    return f"vf/gen/{g}"


def control_key(n: int) -> str:
    return f"vf/control/{n}"


def next_key(worker: int, generation: int) -> str:
    return f"vf/member/{worker}/next/{generation}"


def arrived_key(generation: int) -> str:
    return f"vf/gen/{generation}/arrived"


def ready_key(generation: int) -> str:
    """Set once every member of ``generation`` has arrived (by the member whose arrival completed
    the count) or once the coordinator aborted it: the one key the members wait on, server side."""
    return f"vf/gen/{generation}/ready"


def formed_key(generation: int) -> str:
    return f"vf/gen/{generation}/formed"


def abort_key(generation: int) -> str:
    return f"vf/gen/{generation}/abort"


def heartbeat_key(worker: int) -> str:
    return f"vf/hb/{worker}"


# -- schemas ---------------------------------------------------------------------------------
# A spec is INT, NUM, STR, BOOL, or ("list" | "opt" | "map", spec). NUM accepts ints; bools are
# never numbers.
INT, NUM, STR, BOOL = "int", "num", "str", "bool"


def LIST(spec: Any) -> tuple[str, Any]:
    return ("list", spec)


def OPT(spec: Any) -> tuple[str, Any]:
    return ("opt", spec)


def MAP(spec: Any) -> tuple[str, Any]:
    """A JSON object with string keys and values of ``spec``."""
    return ("map", spec)


REPORT_FIELDS = {"type": STR, "worker": INT, "pid": INT, "seq": INT}
"""Every report: what it is, who sent it (worker id, process id) and its sequence number (1, 2,
... per worker: a report is accepted only above the last one accepted from that worker)."""

REPORTS: dict[str, dict[str, Any]] = {
    "join": {"setup_s": NUM, "dataset": OPT(MAP(STR))},
    "formed": {"generation": INT, "members": LIST(INT), "step": INT, "hold": BOOL, "group_s": NUM,
               "transfer_s": NUM, "bytes": INT, "source": OPT(INT), "receivers": LIST(INT), "form_s": NUM,
               "time": NUM, "exchange": OPT(STR), "exchange_reason": OPT(STR)},
    "fault": {"generation": INT, "phase": STR, "step": INT, "error": STR},
    "held": {"generation": INT, "step": INT, "checkpoint": STR},
    "step": {"step": INT, "loss": NUM, "samples": INT, "step_time_s": NUM, "workers": INT, "generation": INT,
             "vns": LIST(LIST(INT)), "members": LIST(INT), "compute_s": OPT(LIST(NUM)),
             "vn_sizes": OPT(LIST(INT)), "time": NUM},
    "checkpoint": {"step": INT, "path": STR, "save_s": NUM},
    "eval": {"step": INT, "metrics": MAP(NUM), "eval_time_s": NUM},
    "error": {"error": STR, "traceback": STR, "step": OPT(INT)},
    "done": {"step": INT, "rank": INT, "peak_rss_mib": NUM, "peak_device_mib": OPT(NUM), "optimizer_bytes": INT, "replica_bytes": INT,
             "replica_refresh_s": NUM, "redundant_forwards": MAP(NUM)},
    "leave": {"step": INT},
    "notice": {"step": INT},
    "arrived": {"generation": INT},
    "rejected": {"channel": STR, "reason": STR, "message": STR, "bytes": INT},
}
"""Fields of each report type beyond :data:`REPORT_FIELDS` (``rejected``: a worker refused a
message it read from the store and says so, for ``events.jsonl``; ``join.dataset``: the
fingerprint of the dataset the worker built, :mod:`virtualflow.runtime.dataset_check`, None when
it could not be taken)."""

REQUEST = {"op": STR, "workers": INT, "source": STR, "nonce": STR}
"""``virtualflow resize``: ``op`` is ``resize``."""
JOIN = {"op": STR, "host": STR, "pid": INT, "nonce": STR}
"""``virtualflow worker --join``: ``op`` is ``join``."""
WELCOME = {"op": STR, "worker": INT, "request": STR, "config": STR}
"""The coordinator's answer to a join: the worker's id and the job's configuration."""
COMMANDS: dict[str, dict[str, Any]] = {
    "stop": {},
    "regroup": {"generation": INT},
    "slowdown": {"worker": INT, "factor": NUM},
    "batch": {"virtual_nodes": INT, "lr_rule": STR},
}
GENERATION = {"generation": INT, "members": LIST(INT), "assignment": LIST(LIST(INT)), "start_step": INT,
              "hold": BOOL, "reason": STR, "vn_sizes": OPT(LIST(INT)), "layout": OPT(LIST(LIST(INT)))}


def check(value: Any, spec: Any, where: str = "message") -> None:
    """Raise :class:`BadMessage` unless ``value`` is of ``spec`` (a schema dict or a spec)."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise BadMessage(f"{where} is a {type(value).__name__}, not an object")
        for name, field_spec in spec.items():
            if name not in value:
                raise BadMessage(f"{where} lacks the field {name!r}")
            check(value[name], field_spec, f"{where}.{name}")
        return
    if spec == INT:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif spec == NUM:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif spec == BOOL:
        ok = isinstance(value, bool)
    elif spec == STR:
        ok = isinstance(value, str) and len(value) <= MAX_TEXT
    elif spec[0] == "opt":
        if value is not None:
            check(value, spec[1], where)
        return
    elif spec[0] == "list":
        if not isinstance(value, list) or len(value) > MAX_ITEMS:
            raise BadMessage(f"{where} is not a list of at most {MAX_ITEMS} items")
        if _plain(value, spec[1]):
            return
        for i, item in enumerate(value):
            check(item, spec[1], f"{where}[{i}]")
        return
    elif spec[0] == "map":
        if not isinstance(value, dict) or len(value) > MAX_ITEMS:
            raise BadMessage(f"{where} is not an object of at most {MAX_ITEMS} fields")
        for k, item in value.items():
            check(item, spec[1], f"{where}.{k[:40]}")
        return
    else:  # pragma: no cover - a mistake in the schemas above
        raise AssertionError(f"unknown spec {spec!r}")
    if not ok:
        raise BadMessage(f"{where} is {_kind_of(value)}, not {spec}")


def _plain(items: list, spec: Any) -> bool:
    """True when every item of ``items`` is of ``spec`` by exact type (``INT``, ``NUM`` or a list
    of those, at most :data:`MAX_ITEMS` long): the common case of a step report's VN map or a
    generation's member list, checked without a call or a location string per item (a report
    of 4,096 VNs). False only means "look item by item": :func:`check` then finds the culprit
    and names it."""
    if spec == INT:
        return all(type(x) is int for x in items)
    if spec == NUM:
        return all(type(x) is int or type(x) is float for x in items)
    if isinstance(spec, tuple) and spec[0] == "list" and spec[1] in (INT, NUM):
        return all(type(v) is list and len(v) <= MAX_ITEMS and _plain(v, spec[1]) for v in items)
    return False


def _kind_of(value: Any) -> str:
    return f"a {type(value).__name__}" if not isinstance(value, str) else f"a string of {len(value)} characters"


# -- the run key and the messages it signs ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class RunKey:
    """The run's signing key and its job id: what signs and checks every message the run's own
    processes exchange (see :mod:`virtualflow.comm.auth`)."""

    key: str
    job: str

    def seal(self, kind: str, payload: dict[str, Any]) -> str:
        return auth.sign(self.key, payload, job=self.job, kind=kind, fresh=False)

    def open(self, kind: str, raw: Any, max_bytes: int) -> dict[str, Any]:
        return auth.verify(self.key, raw, job=self.job, kind=kind, fresh=False, max_bytes=max_bytes)


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """One membership epoch: who works, which VNs each runs, from which step on."""

    generation: int
    members: list[int]
    """Worker ids; a worker's rank in this generation is its index here."""
    assignment: list[list[int]]
    """``assignment[rank]`` = VN ids that rank runs, in order."""
    start_step: int
    """Step the generation was published at (informational: members agree on the step to run
    when they form the group; a newcomer learns it in the state transfer)."""
    hold: bool = False
    """Fewer members than ``min_workers``: form, checkpoint, and wait for the next generation
    instead of training."""
    reason: str = ""
    vn_sizes: list[int] | None = None
    """Samples per VN when VN sizes differ per worker (``uneven_vn_sizes``); None: ``B/V`` each."""
    layout: list[list[int]] | None = None
    """A pipelined job after a Bamboo failover: the stages each member runs (one pipeline
    replica, in order; :mod:`virtualflow.plan.pipeline.failover`). None: member ``r`` runs stage
    ``r mod p``."""

    def seal(self, run: RunKey) -> str:
        return run.seal("generation", asdict(self))


def parse_generation(run: RunKey, raw: Any, generation: int) -> GenerationRecord:
    """The record of ``generation`` read from ``vf/gen/<generation>``."""
    p = run.open("generation", raw, MAX_RECORD_BYTES)
    check(p, GENERATION, "generation record")
    if p["generation"] != generation:
        raise BadMessage(f"the record of generation {p['generation']} stored as generation {generation}'s")
    if len(p["assignment"]) != len(p["members"]) or len(set(p["members"])) != len(p["members"]):
        raise BadMessage("generation record: members and assignment do not match")
    if p["layout"] is not None and len(p["layout"]) != len(p["members"]):
        raise BadMessage("generation record: members and layout do not match")
    return GenerationRecord(**{k: p[k] for k in GENERATION})


def seal_command(run: RunKey, seq: int, op: str, fields: dict[str, Any]) -> str:
    return run.seal("command", {"seq": seq, "op": op, **fields})


def parse_command(run: RunKey, raw: Any, seq: int) -> dict[str, Any]:
    """Control command ``seq`` read from ``vf/control/<seq>``: ``{"op": ..., fields}``."""
    p = run.open("command", raw, MAX_CONTROL_BYTES)
    check(p, {"seq": INT, "op": STR}, "command")
    if p["seq"] != seq:
        raise BadMessage(f"command {p['seq']} stored as command {seq}")
    spec = COMMANDS.get(p["op"])
    if spec is None:
        raise BadMessage(f"unknown command op {p['op'][:40]!r}")
    check(p, spec, f"{p['op']} command")
    if p["op"] == "slowdown" and not 0 < p["factor"] < float("inf"):
        raise BadMessage(f"slowdown factor {p['factor']!r} is not a positive finite number")
    return p


def seal_next(run: RunKey, worker: int, after: int, to: str) -> str:
    return run.seal("next", {"worker": worker, "after": after, "to": to})


def parse_next(run: RunKey, raw: Any, worker: int, after: int) -> str:
    """Where ``worker`` goes after generation ``after``: ``"<g>"``, ``"leave <g>"`` or ``"fail"``."""
    p = run.open("next", raw, MAX_CONTROL_BYTES)
    check(p, {"worker": INT, "after": INT, "to": STR}, "next pointer")
    if (p["worker"], p["after"]) != (worker, after):
        raise BadMessage(f"the next pointer of worker {p['worker']} after generation {p['after']} stored as "
                         f"worker {worker}'s after generation {after}")
    if not _NEXT.fullmatch(p["to"]):
        raise BadMessage(f"next pointer {p['to'][:40]!r} is not a generation, 'leave <g>' or 'fail'")
    return p["to"]


def seal_abort(run: RunKey, generation: int) -> str:
    return run.seal("abort", {"generation": generation})


def parse_abort(run: RunKey, raw: Any, generation: int) -> None:
    """Return if ``raw`` (read from ``vf/gen/<generation>/abort``) truly declares the generation
    broken; :class:`BadMessage` otherwise."""
    p = run.open("abort", raw, MAX_CONTROL_BYTES)
    check(p, {"generation": INT}, "abort flag")
    if p["generation"] != generation:
        raise BadMessage(f"generation {p['generation']}'s abort flag stored as generation {generation}'s")


def parse_seq(raw: Any) -> int | None:
    """A plain counter (``vf/control/seq``); None when it is not a decimal number."""
    if isinstance(raw, (bytes, bytearray)) and _SEQ.fullmatch(raw):
        return int(raw)
    return None


# -- reports ---------------------------------------------------------------------------------
class ReportTooLarge(ValueError):
    """A report this process made is over :data:`MAX_REPORT_BYTES`: the coordinator would refuse
    it unread (``report_rejected``) and the step's record would be lost, so the sender fails
    instead, naming the limit and the largest field."""


_FIELD_HINTS = {
    "metrics": "return fewer or shorter metric names from Job.loss",
    "error": "shorten the exception's message",
    "traceback": "shorten the exception's message",
}


def seal_report(run: RunKey, message: dict[str, Any]) -> str:
    """The signed text of ``message``; :class:`ReportTooLarge` if it would not fit the report
    channel (checked here, where it is made: a report over the limit is never sent)."""
    sealed = run.seal("report", message)
    size = len(sealed.encode())
    if size > MAX_REPORT_BYTES:
        sizes = {k: len(json.dumps(v, default=str)) for k, v in message.items()}
        field = max(sizes, key=sizes.__getitem__)
        step = message.get("step")
        at = f" at step {step}" if isinstance(step, int) else ""
        hint = _FIELD_HINTS.get(field, "a report that large is a bug: please report it")
        raise ReportTooLarge(
            f"the {str(message.get('type'))[:40]} report of worker {message.get('worker')}{at} is {size} bytes, over "
            f"the limit of {MAX_REPORT_BYTES} bytes ({MAX_REPORT_BYTES // 1024} KiB) per report; its largest field "
            f"is {field!r} ({sizes[field]} bytes): {hint}")
    return sealed


def push_report(store: dist.Store, run: RunKey, message: dict[str, Any]) -> None:
    store.queue_push(REPORTS_QUEUE, seal_report(run, message))


class ReportReader:
    """Checks the workers' reports: signature, schema, and a sequence number above the last
    one accepted from the same worker (a report queued again is refused)."""

    def __init__(self, run: RunKey) -> None:
        self.run = run
        self.last_seq: dict[int, int] = {}

    def parse(self, raw: Any) -> dict[str, Any]:
        p = self.run.open("report", raw, MAX_REPORT_BYTES)
        check(p, REPORT_FIELDS, "report")
        spec = REPORTS.get(p["type"])
        if spec is None:
            raise BadMessage(f"unknown report type {p['type'][:40]!r}")
        check(p, spec, f"{p['type']} report")
        worker, seq = p["worker"], p["seq"]
        if seq <= self.last_seq.get(worker, 0):
            raise BadMessage(f"report {seq} of worker {worker} is not after its last one "
                             f"({self.last_seq.get(worker, 0)}): replayed")
        self.last_seq[worker] = seq
        return p


def pop_raw(store: dist.Store, queue: str, limit: int = 1000) -> list[bytes]:
    """Non-blocking: every message queued so far (up to ``limit``), as the raw bytes."""
    n = min(store.queue_len(queue), limit)
    return [store.queue_pop(queue, block=False) for _ in range(n)]


# -- messages signed with the job's token ----------------------------------------------------
def _parse_fresh(token: str, job: str, raw: Any, guard: auth.ReplayGuard | None, *, kind: str, op: str,
                 schema: Any, what: str, max_bytes: int) -> dict[str, Any]:
    """A message from outside the run, signed with the token: verified, then checked."""
    p = auth.verify(token, raw, job=job, kind=kind, guard=guard, max_bytes=max_bytes)
    check(p, schema, what)
    if p["op"] != op:
        raise BadMessage(f"not a {what} (op={p['op'][:40]!r})")
    if not _NONCE.fullmatch(p["nonce"]):
        raise BadMessage(f"the {what}'s nonce is not 16-64 hex digits")
    return p


def parse_request(token: str, job: str, raw: Any, guard: auth.ReplayGuard | None) -> dict[str, Any]:
    """A ``virtualflow resize`` request from the request queue."""
    return _parse_fresh(token, job, raw, guard, kind="request", op="resize", schema=REQUEST, what="resize request",
                        max_bytes=MAX_REQUEST_BYTES)


def parse_join(token: str, job: str, raw: Any, guard: auth.ReplayGuard | None) -> dict[str, Any]:
    """An external worker's join request."""
    return _parse_fresh(token, job, raw, guard, kind="join", op="join", schema=JOIN, what="join request",
                        max_bytes=MAX_JOIN_BYTES)


def parse_welcome(token: str, job: str, raw: Any, request: str) -> dict[str, Any]:
    """The coordinator's answer to the join request with nonce ``request``."""
    p = auth.verify(token, raw, job=job, kind="welcome", max_bytes=MAX_WELCOME_BYTES)
    check(p, WELCOME, "join answer")
    if p["op"] != "welcome" or p["request"] != request:
        raise BadMessage("the answer is not for this join request")
    return p


def claims(raw: Any, max_bytes: int = MAX_JOIN_BYTES) -> dict[str, Any]:
    """What an unverified ``SIG.PAYLOAD`` message says about its sender (``host``, ``pid``,
    ``nonce``), for the log line of a refusal and for answering a misconfigured worker. Never
    trusted; bounded; empty when there is nothing sensible to say."""
    out: dict[str, Any] = {}
    try:
        if not isinstance(raw, (bytes, bytearray)) or len(raw) > max_bytes:
            return out
        body = bytes(raw).partition(b".")[2]
        p = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):
        return out
    if not isinstance(p, dict):
        return out
    if isinstance(p.get("host"), str):
        out["host"] = p["host"][:100]
    if isinstance(p.get("pid"), int) and not isinstance(p.get("pid"), bool):
        out["pid"] = p["pid"]
    if isinstance(p.get("nonce"), str) and _NONCE.fullmatch(p["nonce"]):
        out["nonce"] = p["nonce"]
    return out
