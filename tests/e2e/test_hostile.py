"""A hostile store must never cost a user their job.

The job's TCPStore has no authentication: anyone who reaches it can push to its queues and write
its keys. Every queue and key the job reads is fed messages of the wrong type, shape, size,
nesting and encoding, unsigned, wrongly signed, for another job or channel, and replayed:

* the parsers (:mod:`virtualflow.comm.protocol`, :mod:`virtualflow.comm.auth`) refuse each with a
  ``ValueError`` and nothing else, while the real messages of every channel pass;
* the state transfer's header is data (JSON), bit-exact for real states, refused when it is not;
* refusals are logged within bounds (fields cut short, a budget per minute, refusal answers to
  joins bounded and deleted);
* a worker reading a forged next pointer, record, abort flag or command refuses it, says so
  once, and takes the coordinator's own value when it comes;
* end to end: a deterministic job under a battery of all of the above ends with weights
  bit-identical to an undisturbed run, every message it read logged as refused.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import logging
import os
import pickle
import threading
import time
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

import virtualflow as vf
from conftest import assert_same_training, wait_for_step
from virtualflow.backends import Attachment
from virtualflow.backends import external
from virtualflow.comm import auth, protocol
from virtualflow.comm.rejects import RejectLog
from virtualflow.runtime import transfer
from virtualflow.runtime.channel import ABORT_MARK, Heartbeat, Reporter
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.worker import Worker, WorkerConfig
from vn_reference import deterministic_reference
import jobs

KEY = "k" * 64
TOKEN = "t" * 64
JOB = "0123456789abcdef"
OTHER_JOB = "fedcba9876543210"
RUN = protocol.RunKey(KEY, JOB)
NONCE = "ab" * 16


def master_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def signed_deep(key: str, kind: str, depth: int = 5_000) -> bytes:
    """Correctly signed, nested ``depth`` levels deep: only the key's holder could send it, but
    parsing it must still end in a refusal, not a RecursionError."""
    text = f'{{"kind":"{kind}","job":"{JOB}","x":' + "[" * depth + "]" * depth + "}"
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest().encode() + b"." + text.encode()


# Each channel: how it is read, with which key, what a real message says.
CHANNELS = {
    "report": (lambda raw: protocol.ReportReader(RUN).parse(raw), KEY, "report", False,
               {"type": "leave", "worker": 0, "pid": 1, "seq": 1, "step": 3}),
    "request": (lambda raw: protocol.parse_request(TOKEN, JOB, raw, auth.ReplayGuard()), TOKEN, "request", True,
                {"op": "resize", "workers": 2, "source": "cli"}),
    "join": (lambda raw: protocol.parse_join(TOKEN, JOB, raw, auth.ReplayGuard()), TOKEN, "join", True,
             {"op": "join", "host": "node7", "pid": 4242}),
    "welcome": (lambda raw: protocol.parse_welcome(TOKEN, JOB, raw, NONCE), TOKEN, "welcome", True,
                {"op": "welcome", "worker": 1, "request": NONCE, "config": "cfg"}),
    "command": (lambda raw: protocol.parse_command(RUN, raw, 1), KEY, "command", False, {"seq": 1, "op": "stop"}),
    "generation": (lambda raw: protocol.parse_generation(RUN, raw, 1), KEY, "generation", False,
                   {"generation": 1, "members": [0, 1], "assignment": [[0, 1], [2]], "start_step": 5, "hold": False,
                    "reason": "grow", "vn_sizes": None, "layout": None}),
    "next": (lambda raw: protocol.parse_next(RUN, raw, 0, 1), KEY, "next", False, {"worker": 0, "after": 1, "to": "2"}),
    "abort": (lambda raw: protocol.parse_abort(RUN, raw, 1), KEY, "abort", False, {"generation": 1}),
}


def sign(channel: str, payload: dict | None = None, *, key: str | None = None, job: str = JOB,
         kind: str | None = None) -> bytes:
    _, k, knd, fresh, real = CHANNELS[channel]
    body = real if payload is None else payload
    return auth.sign(key or k, body, job=job, kind=kind or knd, fresh=fresh).encode()


def read(channel: str, raw: bytes):
    return CHANNELS[channel][0](raw)


JUNK = {
    "empty": b"",
    "not JSON": b"hello",
    "not UTF-8": b"\xff\xfe\x00\x80garbage",
    "a JSON array": b"[1, 2, 3]",
    "unsigned JSON": json.dumps({"type": "done", "worker": 0, "rank": 0, "op": "stop", "generation": 1}).encode(),
    "the old envelope": json.dumps({"payload": {"op": "stop"}, "sig": "0" * 64}).encode(),
    "nested 100,000 deep": b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nested and signed-looking": b"0" * 64 + b"." + b"[" * 100_000 + b"]" * 100_000,
    "a non-ASCII signature": ("\u00e9" * 64 + '.{"op":"stop"}').encode(),
    "a NUL signature": b"\x00" * 64 + b".{}",
    "5 MB": b"0" * 64 + b'.{"pad":"' + b"x" * (5 << 20) + b'"}',
}


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_every_channel_takes_its_real_message_and_refuses_junk_with_a_value_error(channel):
    assert read(channel, sign(channel)) is not None or channel == "abort"
    for what, raw in JUNK.items():
        with pytest.raises(ValueError):  # any other exception type fails the test
            read(channel, raw)
    with pytest.raises(ValueError, match="not JSON"):
        read(channel, signed_deep(CHANNELS[channel][1], CHANNELS[channel][2]))


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_every_channel_refuses_another_key_job_or_channel(channel):
    with pytest.raises(auth.AuthError, match="bad signature"):
        read(channel, sign(channel, key="x" * 64))
    with pytest.raises(auth.AuthError, match="another run"):
        read(channel, sign(channel, job=OTHER_JOB))  # captured from a job sharing the token file
    with pytest.raises(auth.AuthError, match="where a"):
        read(channel, sign(channel, kind="other"))


BAD_SHAPES = [
    ("report", {"type": "leave", "worker": 0, "pid": 1, "step": 3}, "lacks the field 'seq'"),
    ("report", {"type": "rm", "worker": 0, "pid": 1, "seq": 1}, "unknown report type"),
    ("report", {"type": "leave", "worker": True, "pid": 1, "seq": 1, "step": 3}, "worker is a bool"),
    ("report", {"type": "leave", "worker": 0, "pid": 1, "seq": 1, "step": "3"}, "step is a string"),
    ("report", {"type": "eval", "worker": 0, "pid": 1, "seq": 1, "step": 3, "eval_time_s": 1,
                "metrics": {"acc": [1]}}, "metrics.acc"),
    ("report", {"type": "error", "worker": 0, "pid": 1, "seq": 1, "step": None, "traceback": "",
                "error": "x" * 100_000}, "error is a string of 100000"),
    ("report", {"type": "step", "worker": 0, "pid": 1, "seq": 1, "step": 3, "loss": 1.0, "samples": 8,
                "step_time_s": 0.1, "workers": 2, "generation": 0, "vns": [[0], [[1]]], "members": [0, 1],
                "compute_s": None, "vn_sizes": None, "time": 0.0}, r"vns\[1\]\[0\]"),
    ("request", {"op": "resize", "workers": "1", "source": "cli"}, "workers is a string"),
    ("request", {"op": "stop", "workers": 1, "source": "cli"}, "not a resize request"),
    ("request", {"op": "resize", "workers": 1}, "lacks the field 'source'"),
    ("join", {"op": "join", "host": ["h"], "pid": 1}, "host is a list"),
    ("join", {"op": "join", "host": "h" * 20_000, "pid": 1}, "over the 16384-byte limit"),
    ("welcome", {"op": "welcome", "worker": 1, "request": "cd" * 16, "config": "c"}, "not for this join"),
    ("command", {"seq": 2, "op": "stop"}, "command 2 stored as command 1"),
    ("command", {"seq": 1, "op": "rm -rf"}, "unknown command op"),
    ("command", {"seq": 1, "op": "regroup"}, "lacks the field 'generation'"),
    ("command", {"seq": 1, "op": "slowdown", "worker": 0, "factor": -1.0}, "not a positive finite"),
    ("command", {"seq": 1, "op": "slowdown", "worker": 0, "factor": float("inf")}, "not a positive finite"),
    ("generation", {"generation": 2, "members": [0], "assignment": [[0]], "start_step": 0, "hold": False,
                    "reason": "", "vn_sizes": None, "layout": None}, "stored as generation 1"),
    ("generation", {"generation": 1, "members": [0, 1], "assignment": [[0]], "start_step": 0, "hold": False,
                    "reason": "", "vn_sizes": None, "layout": None}, "do not match"),
    ("generation", {"generation": 1, "members": ["0"], "assignment": [[0]], "start_step": 0, "hold": False,
                    "reason": "", "vn_sizes": None, "layout": None}, r"members\[0\] is a string"),
    ("next", {"worker": 0, "after": 1, "to": "rm -rf /"}, "not a generation"),
    ("next", {"worker": 0, "after": 1, "to": "leave"}, "not a generation"),
    ("next", {"worker": 1, "after": 1, "to": "2"}, "stored as worker 0"),
    ("abort", {"generation": 0}, "stored as generation 1"),
]


@pytest.mark.parametrize("channel, payload, match", BAD_SHAPES, ids=[f"{c}-{m[:24]}" for c, _, m in BAD_SHAPES])
def test_signed_messages_of_the_wrong_shape_or_place_are_refused(channel, payload, match):
    with pytest.raises(ValueError, match=match):  # BadMessage, or AuthError for the size
        read(channel, sign(channel, payload))


def test_replays_are_refused():
    reader = protocol.ReportReader(RUN)
    reports = [RUN.seal("report", {"type": "leave", "worker": 3, "pid": 1, "seq": n, "step": 0}) for n in (1, 2)]
    reader.parse(reports[1])
    for raw in reports:  # queued again, or an older one after a newer one
        with pytest.raises(protocol.BadMessage, match="replayed"):
            reader.parse(raw)
    guard, request = auth.ReplayGuard(), sign("request")
    protocol.parse_request(TOKEN, JOB, request, guard)
    with pytest.raises(auth.AuthError, match="replayed"):
        protocol.parse_request(TOKEN, JOB, request, guard)
    old = auth.sign(TOKEN, CHANNELS["request"][4], job=JOB, kind="request", now=time.time() - 3600)
    with pytest.raises(auth.AuthError, match="stale"):
        protocol.parse_request(TOKEN, JOB, old, guard)


def test_plain_counters_and_claims_are_read_defensively():
    assert protocol.parse_seq(b"12") == 12
    for raw in (b"abc", b"-1", b"1" * 30, b"", b"\xff", "12", None):
        assert protocol.parse_seq(raw) is None
    forged = b"0" * 64 + b"." + json.dumps({"host": "h" * 5000, "pid": True, "nonce": "../../etc"}).encode()
    assert protocol.claims(forged) == {"host": "h" * 100}
    assert protocol.claims(b"0" * 64 + b"." + b"[" * 10_000) == {}


def test_rejection_logging_is_bounded_per_kind_and_counts_what_it_drops():
    events, clock = [], [0.0]
    log = RejectLog(lambda kind, **f: events.append({"event": kind, **f}), logging.getLogger("test"),
                    clock=lambda: clock[0])
    for i in range(1000):
        log("join_rejected", "bad signature " * 100, b"\xff" + b"A" * 100_000, host="h" * 100_000, pid=i)
    log("report_rejected", "unsigned", b"x")  # another kind has its own budget
    assert [e["event"] for e in events].count("join_rejected") == 30
    assert [e["event"] for e in events].count("report_rejected") == 1
    assert max(len(json.dumps(e)) for e in events) < 1200
    clock[0] = 61.0
    log("join_rejected", "again", b"y")
    summary = [e for e in events if e["event"] == "rejections_suppressed"]
    assert summary == [{"event": "rejections_suppressed", "of": "join_rejected", "count": 970, "per_minute": 30}]
    assert log.suppressed == 970 and log.logged == 32


def worker_config(**kw) -> WorkerConfig:
    fields = dict(store_host="127.0.0.1", store_port=0, job_source=None, total_steps=1, state_dir="/nonexistent",
                  overrides={}, threads=1, resume_path=None, initial_workers=1, slowdowns={},
                  options=WorkerOptions(deterministic=True, device="cpu", collective_timeout_s=10.0),
                  store_timeout_s=10.0, job_id=JOB, run_key=KEY)
    return WorkerConfig(**{**fields, **kw})


def test_external_join_refusals_are_bounded_and_the_configuration_sent_holds_no_key(tmp_path):
    store = master_store()
    events: list[dict] = []
    now = [1000.0]
    backend = external.ExternalBackend(("127.0.0.1", store.port), clock=lambda: now[0])
    cfg = worker_config()
    backend.attach(Attachment(config=cfg, state_dir=str(tmp_path), store=store, token=TOKEN,
                              grow=lambda: "full", event=lambda kind, **f: events.append({"event": kind, **f})))
    sent = external.decode_config(backend.config_text)
    assert sent.run_key == "" and sent.job_id == JOB  # the store is not private: no key goes through it
    pickled = base64.b64decode(backend.config_text)
    assert KEY.encode() not in pickled and TOKEN.encode() not in pickled
    # 50 unsigned joins with a 100 KB field, and 50 wrongly signed ones that name a nonce each.
    for i in range(50):
        store.queue_push(external.JOINS_QUEUE, b"0" * 64 + b'.{"host":"' + b"h" * 100_000 + b'"}')
        store.queue_push(external.JOINS_QUEUE, auth.sign("w" * 64, {"op": "join", "host": "h", "pid": i},
                                                          job=JOB, kind="join"))
    backend.serve([])
    backend.serve([])
    rejected = [e for e in events if e["event"] == "join_rejected"]
    assert len(rejected) == 30 and max(len(json.dumps(e)) for e in events) < 1200
    assert len(backend.refusals) == external.MAX_REFUSALS  # a refusal answer for the first 32 only
    keys = [k for _, k in backend.refusals]
    assert all(store.check([k]) for k in keys)
    now[0] += external.REFUSAL_TTL_S  # the refusal answers' time is up
    backend.serve([])
    assert not any(store.check([k]) for k in keys) and not backend.refusals
    backend.terminate_all()
    assert {"event": "rejections_suppressed", "of": "join_rejected", "count": 70, "per_minute": 30} in events


def adam_state() -> dict:
    torch.manual_seed(0)
    model = jobs.bn_dropout_net()
    opt = jobs.adam(model.parameters())
    sched = jobs.step_lr(opt)
    for _ in range(3):
        model(torch.randn(8, jobs.FEATURES)).sum().backward()
        opt.step()
        sched.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(),
            "step": 3, "control": 0, "odd": {(1, "a"): [float("nan"), -0.0, float("inf"), None, True, ()]}}


def test_state_header_round_trips_bit_exact_with_key_types_and_metadata():
    state = adam_state()
    header, tensors = transfer.encode_header(state)
    skeleton, metas = transfer.decode_header(header)
    assert [(m.dtype, m.shape) for m in metas] == [(t.dtype, tuple(t.shape)) for t in tensors]
    out = transfer.fill_header(skeleton, [t.clone() for t in tensors])
    assert type(out["model"]) is OrderedDict and out["model"]._metadata == state["model"]._metadata
    assert list(out["optimizer"]["state"]) == list(state["optimizer"]["state"]) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert out["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # floats exact, tuples kept
    assert out["lr_scheduler"] == state["lr_scheduler"]
    odd = out["odd"][(1, "a")]
    assert odd[0] != odd[0] and str(odd[1]) == "-0.0" and odd[2:] == [float("inf"), None, True, ()]
    model = jobs.bn_dropout_net()
    model.load_state_dict(out["model"])
    class Custom:
        pass

    with pytest.raises(ValueError, match=r"Custom at state\['optimizer'\]\['x'\]: a state transfer carries"):
        transfer.encode_header({"optimizer": {"x": Custom()}})


@pytest.mark.parametrize("header", [
    pickle.dumps(({"t": 0}, [])),  # a pickle is never loaded
    b'{"skeleton":{"t":0},"tensors":[["object",[1]]]}',
    b'{"skeleton":{"t":0},"tensors":[["float32",[-1]]]}',
    b'{"skeleton":{"t":0},"tensors":[["float32",[true]]]}',
    b'{"skeleton":{"t":0},"tensors":[["float32",' + json.dumps([1] * 65).encode() + b"]]}",
    b'{"skeleton":{"t":5},"tensors":[]}',
    b'{"skeleton":{"t":0,"l":[]},"tensors":[]}',
    b'{"skeleton":{"py":"os.system"},"tensors":[]}',
    b'{"skeleton":{"d":[[{"l":[]},1]]},"tensors":[]}',
    b'{"skeleton":' + b'{"l":[' * 5000 + b"]}" * 5000 + b',"tensors":[]}',
    b'{"skeleton":' + b"[" * 100_000 + b"]" * 100_000 + b',"tensors":[]}',
    "\u00e9".encode(), b"\xff",
])
def test_hostile_state_headers_are_refused(header):
    with pytest.raises(ValueError):
        skeleton, metas = transfer.decode_header(header)
        transfer.fill_header(skeleton, [torch.zeros(1)] * len(metas))


def test_a_worker_refuses_forged_values_says_so_once_and_takes_the_coordinators_own():
    store = master_store()
    reporter = Reporter(store, RUN, 5)
    worker = Worker(worker_config(store_port=store.port), 5, store, reporter)

    def later(key: str, value: str) -> threading.Thread:
        t = threading.Timer(0.4, lambda: store.set(key, value))
        t.start()
        return t

    # A next pointer and a generation record forged ahead of the coordinator's.
    store.set(protocol.next_key(5, 0), "fail")
    later(protocol.next_key(5, 0), protocol.seal_next(RUN, 5, 0, "1"))
    assert worker.next_generation(0) == "1"
    record = protocol.GenerationRecord(1, [5], [[0, 1]], 7)
    store.set(protocol.generation_key(1), json.dumps({"generation": 1, "members": [666], "assignment": [[0]]}))
    later(protocol.generation_key(1), record.seal(RUN))
    assert worker.read_signed(protocol.generation_key(1), lambda raw: protocol.parse_generation(RUN, raw, 1),
                              "generation 1") == record
    # An abort flag: forged means nothing, the coordinator's means broken.
    store.set(protocol.abort_key(1), "1")
    assert not worker.aborted(1) and not worker.aborted(1)
    store.set(protocol.abort_key(1), protocol.seal_abort(RUN, 1))
    assert worker.aborted(1)
    # Commands: a forged one at the next number holds the control position until the real one.
    hb = Heartbeat(worker.cfg, 5, run=RUN, rejections=worker.rejections)
    store.set(protocol.control_key(1), json.dumps({"op": "stop"}))
    hb.follow(store, 10**12)  # a forged sequence number too: followed only as far as commands verify
    assert hb.control_seq == 0
    store.set(protocol.control_key(1), protocol.seal_command(RUN, 1, "slowdown", {"worker": 5, "factor": 2.0}))
    store.set(protocol.control_key(2), store.get(protocol.control_key(1)))  # replayed at the next number
    hb.follow(store, 2)
    assert hb.control_seq == 1 and hb.commands[1]["factor"] == 2.0
    reporter.flush()
    reader = protocol.ReportReader(RUN)
    seen = [reader.parse(raw) for raw in protocol.pop_raw(store, protocol.REPORTS_QUEUE)]
    assert [r["channel"] for r in seen] == ["next 5/0", "generation 1", "abort 1", "command 1", "command 2"]
    assert all(r["type"] == "rejected" and r["worker"] == 5 for r in seen)
    assert "stored as command 2" in seen[-1]["reason"]


def test_ten_thousand_step_reports_verify_in_order_and_a_replay_does_not():
    report = {"type": "step", "step": 1234, "loss": 0.6931471805599453, "samples": 48, "step_time_s": 0.0123,
              "workers": 4, "generation": 3, "vns": [[0, 1], [2, 3], [4, 5], [6, 7]], "members": [0, 1, 2, 3],
              "compute_s": [0.01, 0.011, 0.0105, 0.0099], "vn_sizes": None, "time": time.time(), "worker": 0,
              "pid": 4242}
    reader, n = protocol.ReportReader(RUN), 10_000
    sealed = [protocol.seal_report(RUN, {**report, "seq": seq}) for seq in range(1, n + 1)]
    t0 = time.perf_counter()
    parsed = [reader.parse(m) for m in sealed]
    per_report_us = (time.perf_counter() - t0) / n * 1e6
    print(f"verify + schema of a step report: {per_report_us:.1f} us")  # a figure for the notes, not a test
    assert [p["seq"] for p in parsed] == list(range(1, n + 1))
    assert all(p["type"] == "step" and p["loss"] == report["loss"] and p["vns"] == report["vns"] for p in parsed)
    with pytest.raises(protocol.BadMessage, match="report 1 of worker 0 is not after its last one .*replayed"):
        reader.parse(sealed[0])


# -- end to end ------------------------------------------------------------------------------
FOREVER = 1_000_000


def events(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def wait_until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_job_under_a_hostile_store_trains_bit_identical_and_logs_every_refusal(run_dir):
    handle = vf.launch(jobs.elastic_job, workers=2, steps=FOREVER, deterministic=True, run_dir=run_dir)
    try:
        wait_for_step(handle, 3)
        with open(os.path.join(run_dir, "status.json")) as f:
            status = json.load(f)
        token = auth.read_token(os.path.join(run_dir, "token"))
        job = status["job_id"]
        store = dist.TCPStore("127.0.0.1", status["coordinator"]["port"], is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        tagged: dict[str, bytes] = {}  # tag -> message: each must show up in a refusal event

        def push(queue: str, tag: str, raw: bytes) -> None:
            tagged[tag] = raw
            store.queue_push(queue, raw)

        deep = b"[" * 50_000 + b"]" * 50_000
        for q, name in ((protocol.REPORTS_QUEUE, "R"), (protocol.REQUESTS_QUEUE, "Q")):
            push(q, f"{name}1", f"{name}1 not JSON".encode())
            push(q, f"{name}2", b"\xff\xfe" + f"{name}2".encode() + b"\x00 not UTF-8")
            push(q, f"{name}3", f'{{"t":"{name}3","x":'.encode() + deep + b"}")
            push(q, f"{name}4", f"{name}4".encode() + b"x" * 300_000)
            push(q, f"{name}5", ("\u00e9" * 32 + f'.{{"t":"{name}5"}}').encode())  # 64 bytes, not ASCII
        # A forged report that would end the job, unsigned and signed with the token instead of the run key.
        done = {"type": "done", "worker": 0, "pid": 1, "seq": 10**9, "step": 3, "rank": 0, "peak_rss_mib": 1.0,
                "optimizer_bytes": 0, "replica_bytes": 0}
        push(protocol.REPORTS_QUEUE, "R6", json.dumps({**done, "t": "R6"}).encode())
        push(protocol.REPORTS_QUEUE, "R7", auth.sign(token, {**done, "t": "R7"}, job=job, kind="report",
                                                     fresh=False).encode())
        # Requests to shrink to 1: unsigned, wrong token, another job's, of the wrong shape, impossible.
        resize = {"op": "resize", "workers": 1, "source": "cli"}
        push(protocol.REQUESTS_QUEUE, "Q6", json.dumps({**resize, "t": "Q6"}).encode())
        push(protocol.REQUESTS_QUEUE, "Q7", auth.sign("f" * 64, {**resize, "t": "Q7"}, job=job,
                                                      kind="request").encode())
        push(protocol.REQUESTS_QUEUE, "Q8", auth.sign(token, {**resize, "t": "Q8"}, job=OTHER_JOB,
                                                      kind="request").encode())
        push(protocol.REQUESTS_QUEUE, "Q9", auth.sign(token, {**resize, "workers": "1", "t": "Q9"}, job=job,
                                                      kind="request").encode())
        push(protocol.REQUESTS_QUEUE, "Q10", auth.sign(token, {**resize, "workers": 99, "t": "Q10"}, job=job,
                                                       kind="request").encode())
        # A genuine request that changes nothing (2 workers), then the same bytes again: a replay.
        same = auth.sign(token, {**resize, "workers": 2, "t": "Q11"}, job=job, kind="request").encode()
        store.queue_push(protocol.REQUESTS_QUEUE, same)
        push(protocol.REQUESTS_QUEUE, "Q11", same)
        # Keys the workers read: forged commands at the next number, a garbage and a huge control
        # number, a forged abort flag of the current generation, the next generation's record and
        # pointers, and the newcomer's entry point ahead of the coordinator's.
        store.set(protocol.CONTROL_SEQ_KEY, "1")
        forged_commands = [json.dumps({"op": "stop", "t": "C1"}),
                           auth.sign("f" * 64, {"seq": 1, "op": "regroup", "generation": 1, "t": "C2"}, job=job,
                                     kind="command", fresh=False),
                           "\u00e9" * 32 + '.{"op":"slowdown","worker":0,"factor":100,"t":"C3"}']
        for raw in forged_commands:
            store.set(protocol.control_key(1), raw)
            time.sleep(0.4)  # a few heartbeats: each member reads (and refuses) each
        store.set(protocol.CONTROL_SEQ_KEY, "not a number")
        time.sleep(0.2)
        store.set(protocol.CONTROL_SEQ_KEY, str(10**15))
        store.set(protocol.abort_key(0), '{"t":"A1"}')
        for w in (0, 1):  # the mark a real abort adds: each member reads the forged flag at its next beat
            store.add(protocol.heartbeat_key(w), ABORT_MARK)
        store.set(protocol.generation_key(1), json.dumps({"generation": 1, "members": [0], "assignment": [[0]],
                                                          "start_step": 0, "t": "G1"}))
        store.set(protocol.GENERATION_KEY, "1")
        store.set(protocol.next_key(0, 0), "fail")
        store.set(protocol.next_key(2, -1), '{"to":"leave 1","t":"N1"}')
        tagged.update(C1=b"", C2=b"", C3=b"", A1=b"", N1=b"")
        step = handle.status()["step"]
        wait_for_step(handle, step + 5)  # the job goes on, still generation 0 with 2 workers
        assert handle.status()["generation"] == 0 and handle.status()["target_workers"] == 2

        # A real resize: its records, pointers and regroup command replace the forged ones.
        handle.resize(3, wait=True, timeout_s=90)
        wait_for_step(handle, handle.status()["step"] + 3)
        # The real regroup command (1), replayed at the next number: refused, nothing happens.
        store.set(protocol.control_key(2), store.get(protocol.control_key(1)))
        store.set(protocol.CONTROL_SEQ_KEY, "2")
        wait_for_step(handle, handle.status()["step"] + 5)
        assert handle.status()["generation"] == 1
        result = handle.stop()
    finally:
        if not handle.done:
            handle.kill()
    assert not result.failures and result.generations == 2
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [2, 3]
    assert_same_training(result, deterministic_reference(jobs.elastic_job().replace(loss=jobs.cross_entropy),
                                                         result.steps))

    log = events(run_dir)
    refused = [e for e in log if e["event"].endswith("_rejected")]
    text = "\n".join(json.dumps(e) for e in refused)
    # N1 (the newcomer's forged entry point) is refused only when the newcomer reads its pointer
    # before the coordinator writes the real one, a race with the join it reports: under load
    # the real one may come first. Either way the newcomer joined the real generation (above);
    # the refusal itself is proven without timing by the channel tests at the top of this file.
    missing = [tag for tag in tagged if tag not in text and tag != "N1"]
    assert not missing, f"not logged as refused: {missing}"
    assert "replayed" in text and "another run" in text and "stored as command 2" in text
    kinds = {e["event"] for e in refused}
    assert {"report_rejected", "request_rejected", "command_rejected", "abort_rejected", "next_rejected"} <= kinds
    assert not any(e["event"] in ("fault", "failure", "failed") for e in log)
    assert [e["workers"] for e in log if e["event"] == "resize_request"] == [2, 3]  # the replay counted once
    # Bounded: the battery held ~1 MB; what it left in events.jsonl is a few hundred bytes a message.
    assert max(len(json.dumps(e)) for e in refused) < 1500
    assert len(text) < 60 * 1024


@pytest.mark.slow
def test_an_external_job_under_hostile_joins_trains_bit_identical_with_a_bounded_log(tmp_path):
    from test_external import free_port, reap, settled, start_worker

    run_dir = str(tmp_path / "run")
    address = f"127.0.0.1:{free_port()}"
    handle = vf.launch(jobs.elastic_job, workers=2, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       backend="external", listen=address)
    token_file = os.path.join(run_dir, "token")
    procs = [start_worker(address, token_file, str(tmp_path / f"w{i}.log")) for i in range(2)]
    try:
        wait_until(lambda: settled(handle, 2) and handle.status()["step"] >= 3, "two joined workers training")
        token = auth.read_token(token_file)
        with open(os.path.join(run_dir, "status.json")) as f:
            job = json.load(f)["job_id"]
        store = dist.TCPStore("127.0.0.1", int(address.rsplit(":", 1)[1]), is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        join = {"op": "join", "host": "intruder", "pid": 1}
        battery = [b"not JSON", b"\xff\xfe\x00", b'{"x":' + b"[" * 8000 + b"]" * 8000 + b"}",
                   ("\u00e9" * 32 + ".{}").encode(),
                   auth.sign("f" * 64, join, job=job, kind="join").encode(),  # another token
                   auth.sign(token, join, job=OTHER_JOB, kind="join").encode(),  # another job's
                   auth.sign(token, join, job=job, kind="join", now=time.time() - 3600).encode(),  # stale
                   auth.sign(token, {**join, "pid": "1"}, job=job, kind="join").encode()]  # wrong shape
        battery += [b"0" * 64 + b'.{"host":"' + b"h" * 100_000 + b'"}'] * 50  # 5 MB of unsigned joins
        before = os.path.getsize(os.path.join(run_dir, "events.jsonl"))
        for raw in battery:
            store.queue_push(external.JOINS_QUEUE, raw)
        step = handle.status()["step"]
        wait_for_step(handle, step + 5)
        assert settled(handle, 2) and handle.status()["generation"] == 0
        result = handle.stop()
    finally:
        if not handle.done:
            handle.kill()
        codes = reap(procs)
    assert codes == [0, 0]
    assert not result.failures and {h["workers"] for h in result.history} == {2}
    assert_same_training(result, deterministic_reference(jobs.elastic_job().replace(loss=jobs.cross_entropy),
                                                         result.steps))
    log = events(run_dir)
    rejected = [e for e in log if e["event"] == "join_rejected"]
    suppressed = sum(e["count"] for e in log if e["event"] == "rejections_suppressed" and e["of"] == "join_rejected")
    assert len(rejected) == 30 and len(rejected) + suppressed == len(battery)
    reasons = " ".join(e["reason"] for e in rejected)
    for why in ("unsigned", "over the 16384-byte limit", "bad signature", "another run", "stale", "pid is a string"):
        assert why in reasons, why
    # The battery carried 5 MB; it grew events.jsonl by a few hundred bytes a logged refusal.
    grown = sum(len(json.dumps(e)) for e in rejected)
    assert grown < 30 * 1200 and os.path.getsize(os.path.join(run_dir, "events.jsonl")) - before < 200_000
    assert not [e for e in log if e["event"] in ("joined", "join_request") and e.get("host") == "intruder"]
