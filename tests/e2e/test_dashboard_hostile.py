"""The dashboard's port is not a way in (issue 27): hostile clients against the real server.

Pure checks first (the Host and Content-Length rule, job ids, the sampled loss curve, the
rate-limited log), then one uvicorn server in a thread, with small limits so that each attack
takes well under a second: a DNS-rebinding Host, a body far over the limit (declared or chunked),
half-open and trickling connections, more connections than the cap, ids that are not row ids,
and a flood of failing requests.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import threading
import time

import pytest

from virtualflow.service import dashboard
from virtualflow.service.dashboard import (CURVE_POINTS, bind, make_server, parse_job_id, read_losses,
                                           refuse_request)
from virtualflow.service.runner import init_cluster
from virtualflow.service.webguard import RateLimitedLog, WebLimits

LIMITS = WebLimits(max_connections=6, request_timeout_s=0.5, max_body_bytes=4096, error_log_burst=3,
                   error_log_window_s=60.0)


def scope(host: bytes | None, *extra: tuple[bytes, bytes], server: tuple[str, int] = ("127.0.0.1", 8266)) -> dict:
    headers = ([(b"host", host)] if host is not None else []) + list(extra)
    return {"type": "http", "server": server, "headers": headers}


# -- pure rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("host,server,refused", [
    (b"127.0.0.1:8266", "127.0.0.1", None),
    (b"localhost:9000", "127.0.0.1", None),  # through ssh -L 9000:127.0.0.1:8266
    (b"LOCALHOST", "127.0.0.1", None),
    (b"[::1]:8266", "::1", None),
    (b"evil.example:8266", "127.0.0.1", 400),  # DNS rebinding: another site's name for 127.0.0.1
    (b"127.0.0.1.evil.example", "127.0.0.1", 400),
    (b"[::1]:8266", "127.0.0.1", 400),  # not the bound family
    (b"10.0.0.5:8266", "127.0.0.1", 400),
    (None, "127.0.0.1", 400),
])
def test_only_the_bound_loopback_names_are_answered(host, server, refused):
    got = refuse_request(scope(host, server=(server, 8266)), LIMITS)
    assert (got and got[0]) == refused, got
    if refused:
        assert "answers to" in got[1] and ("localhost" in got[1])


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read():
    ok = refuse_request(scope(b"127.0.0.1", (b"content-length", b"4096")), LIMITS)
    big = refuse_request(scope(b"127.0.0.1", (b"content-length", b"300000000")), LIMITS)
    bad = refuse_request(scope(b"127.0.0.1", (b"content-length", b"12, 12")), LIMITS)
    assert ok is None and big[0] == 413 and "300000000" in big[1] and "4096" in big[1] and bad[0] == 400


def test_job_ids_that_cannot_be_row_ids_are_none():
    assert parse_job_id("42") == 42 and parse_job_id("9223372036854775807") == 2**63 - 1
    for text in ("9223372036854775808", "99999999999999999999", "9" * 4300, "", "-1", "1e3", "\u0663", " 1"):
        assert parse_job_id(text) is None, text


def write_metrics(path: str, steps: int) -> None:
    with open(path, "w") as f:
        for step in range(steps):
            f.write(json.dumps({"time": 1.7e9 + step, "step": step, "loss": 1.0 / (1 + step), "workers": 2,
                                "samples": 64, "step_time_s": 0.0123456789}) + "\n")
        f.write('{"step": 99999999, "lo')  # torn last line: a run killed mid-write


def test_a_large_metrics_file_is_sampled_not_read(tmp_path, monkeypatch):
    """Every step of a small file; at most CURVE_POINTS (+ the last) of a large one, each a real
    record (loss = 1/(1+step)), first and last steps included, reading a small part of it."""
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir(), large.mkdir()
    write_metrics(str(small / "metrics.jsonl"), 300)
    assert read_losses(str(small)) == [(s, 1.0 / (1 + s)) for s in range(300)]
    steps = 60000
    write_metrics(str(large / "metrics.jsonl"), steps)
    size = os.path.getsize(large / "metrics.jsonl")
    assert size > 4 * dashboard.WHOLE_FILE_BYTES
    read = [0]
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            read[0] += len(data)
            return data

        def __iter__(self):
            for line in self.f:
                read[0] += len(line)
                yield line

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def counting_open(path, mode="r", *args, **kwargs):
        return Counting(real_open(path, mode, *args, **kwargs))

    monkeypatch.setattr(dashboard, "open", counting_open, raising=False)
    points = read_losses(str(large))
    assert 0.9 * CURVE_POINTS <= len(points) <= CURVE_POINTS + 1
    assert points[0] == (0, 1.0) and points[-1] == (steps - 1, 1.0 / steps)
    assert all(loss == 1.0 / (1 + s) for s, loss in points)
    assert [s for s, _ in points] == sorted({s for s, _ in points})
    gaps = [b[0] - a[0] for a, b in zip(points, points[1:])]
    assert max(gaps) <= 2 * steps / CURVE_POINTS  # spread through the run, not bunched at one end
    assert read[0] < size / 4, (read[0], size)


def test_the_error_log_passes_a_burst_per_window_and_counts_the_rest():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("test_dashboard_hostile.ratelimit")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    now = [0.0]
    rl = RateLimitedLog(logger, burst=3, window_s=60.0, clock=lambda: now[0])
    for _ in range(100):
        try:
            raise RuntimeError("boom")
        except RuntimeError as exc:
            rl.error("Exception in ASGI application", exc_info=exc)
    assert len(records) == 3 and rl.dropped == 97 and all(r.exc_info for r in records)
    now[0] = 61.0
    rl.warning("Invalid HTTP request received.")
    assert len(records) == 4 and "97 similar lines" in records[-1].getMessage() and rl.dropped == 0
    rl.info("info lines are not limited")
    assert len(records) == 5


# -- the real server -------------------------------------------------------------------------------
@pytest.fixture
def server(tmp_path):
    d = str(tmp_path / "c")
    db = init_cluster(d, slots={"v100": 2}, policy="fifo", round_s=5.0)
    jid = db.add_job(name="secret-job", target="/x/job.py:make", deterministic=True, checkpoint_every=5,
                     priority=1.0, job_type=None, steps=10, elastic=False, min_workers=1, max_workers=1, now=1.0)
    db.close()
    sock = bind("127.0.0.1", 0)
    srv = make_server(d, limits=LIMITS)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.02)
    with open(os.path.join(d, "token")) as f:
        token = f.read().strip()
    yield d, sock.getsockname()[1], jid, token
    srv.should_exit = True
    thread.join(10)


def request(port: int, method: str, path: str, *, host: str | None = None, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_a_rebinding_page_cannot_read_the_state(server):
    d, port, jid, token = server
    status, body = request(port, "GET", "/api/state", host=f"attacker.example:{port}")
    assert status == 400 and b"secret-job" not in body and b"run_dir" not in body
    status, body = request(port, "GET", "/api/state", host=f"localhost:{port}")
    assert status == 200 and json.loads(body)["jobs"][0]["name"] == "secret-job"
    # ... nor act with a token it somehow had: the Host is checked first.
    status, _ = request(port, "POST", f"/jobs/{jid}/cancel", host="attacker.example",
                        headers={"Authorization": f"Bearer {token}"})
    assert status == 400


def test_bodies_over_the_limit_are_refused_unread(server):
    d, port, jid, token = server
    # Declared: 300 MB announced, nothing sent; the answer comes at once.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /jobs/{jid}/cancel HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 300000000\r\n"
                  f"Content-Type: application/x-www-form-urlencoded\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    # Chunked (no Content-Length): refused once past the limit, not read to its end.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /jobs/{jid}/cancel HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                  f"Content-Type: application/x-www-form-urlencoded\r\n\r\n".encode())
        chunk = b"a" * 1024
        answer = b""
        for _ in range(64):  # up to 64 KiB, 16x the limit
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                break
            s.settimeout(0.05)
            try:
                answer = s.recv(4096)
            except socket.timeout:
                continue
            finally:
                s.settimeout(10)
            if answer:
                break
        assert answer.startswith(b"HTTP/1.1 413"), answer
    from virtualflow.service.state import ClusterDB

    assert ClusterDB(d).job(jid).state == "queued"  # nothing was cancelled
    status, _ = request(port, "POST", f"/jobs/{jid}/cancel", body=f"token={token}".encode(),
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200 and ClusterDB(d).job(jid).state == "cancelled"  # a small body still works


def test_a_head_growing_past_the_limit_is_refused(server):
    """Headers still incomplete after max_header_bytes are answered 400 (not buffered on)."""
    d, port, jid, token = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for k in range(2 * LIMITS.max_header_bytes // 1024):
            try:
                s.sendall(b"X-Pad-%d: %s\r\n" % (k, b"a" * 1000))
            except OSError:
                break
        assert s.recv(4096).startswith(b"HTTP/1.1 400")


@contextlib.contextmanager
def uvicorn_errors():
    """The records uvicorn's error logger emits inside the block (after the rate limit)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)


def test_ids_that_are_not_row_ids_are_404_without_a_traceback(server):
    d, port, jid, token = server
    with uvicorn_errors() as records:
        for path in ("/jobs/99999999999999999999", "/jobs/" + "9" * 4300, "/jobs/9223372036854775808",
                     f"/jobs/{jid + 1}"):
            status, body = request(port, "GET", path)
            assert status == 404 and b"does not exist" in body and len(body) < 5000, (path, status)
        status, _ = request(port, "POST", "/jobs/" + "9" * 30 + "/cancel",
                            headers={"Authorization": f"Bearer {token}"})
        assert status == 404
    assert records == []


def test_a_flood_of_failing_requests_logs_a_few_lines(server):
    d, port, jid, token = server
    os.rename(os.path.join(d, "cluster.db"), os.path.join(d, "moved.db"))  # every page now fails
    with uvicorn_errors() as records:
        for _ in range(30):
            status, body = request(port, "GET", "/")
            assert status == 500 and b"Traceback" not in body
    assert len(records) == LIMITS.error_log_burst


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_half_open_and_trickling_connections_are_closed(server):
    d, port, jid, token = server
    silent = socket.create_connection(("127.0.0.1", port))
    partial = socket.create_connection(("127.0.0.1", port))
    partial.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
    trickle = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    try:
        for k in range(12):  # a header line every 0.1 s: each arrives in time, the request never does
            trickle.sendall(b"X-%d: y\r\n" % k if k else b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            time.sleep(0.1)
    except OSError:
        pass
    for s in (silent, partial, trickle):
        assert closed_by_server(s, 5.0)
        s.close()
    assert time.monotonic() - t0 < 5.0
    assert request(port, "GET", "/")[0] == 200  # and the server still answers


def test_connections_are_capped_far_below_the_descriptor_limit(server):
    d, port, jid, token = server
    before = open_fds()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        time.sleep(0.2)
        # This process holds the 40 client ends; the server holds at most the cap.
        assert open_fds() - before - len(socks) <= LIMITS.max_connections + 1
        closed = sum(closed_by_server(s, 0.05) for s in socks)
        assert closed >= len(socks) - LIMITS.max_connections
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # served again once the held ones are gone
        try:
            if request(port, "GET", "/")[0] == 200:
                break
        except (OSError, http.client.HTTPException):
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


# What the service's loop does all the time (open its database, logs, pipes to workers), in a
# process whose descriptor limit is low, while a client floods the dashboard with connections.
SERVER_UNDER_A_LOW_LIMIT = r"""
import errno, os, resource, sys, threading, time
from virtualflow.service.dashboard import bind, make_server

resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
sock = bind("127.0.0.1", 0)
server = make_server(sys.argv[1])
threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
while not server.started:
    time.sleep(0.01)
emfile, rounds = [0], [0]

def scheduler():
    while True:
        try:
            fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(8)]
        except OSError as exc:
            emfile[0] += exc.errno == errno.EMFILE
        else:
            for fd in fds:
                os.close(fd)
            rounds[0] += 1
        time.sleep(0.001)

threading.Thread(target=scheduler, daemon=True).start()
print(sock.getsockname()[1], flush=True)
sys.stdin.readline()
print(emfile[0], rounds[0], flush=True)
"""


def test_a_connection_flood_leaves_the_schedulers_descriptors_alone(tmp_path):
    """1000 connections at once against a server process limited to 256 descriptors (default
    limits: 32 connections, a backlog of 64): its other thread never meets EMFILE."""
    import subprocess
    import sys

    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 1}, policy="fifo", round_s=5.0).close()
    child = subprocess.Popen([sys.executable, "-c", SERVER_UNDER_A_LOW_LIMIT, d, "256"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    socks: list[socket.socket] = []
    try:
        port = int(child.stdout.readline())
        for _ in range(1000):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        time.sleep(1.5)
        child.stdin.write("done\n")
        child.stdin.flush()
        emfile, rounds = map(int, child.stdout.readline().split())
    finally:
        for s in socks:
            s.close()
        child.kill()
        child.wait(10)
    assert rounds > 0 and emfile == 0, (emfile, rounds)
