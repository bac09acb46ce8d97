"""The cluster service's web dashboard: Starlette on loopback, server-rendered HTML and SVG.

Pages (all read-only, from the cluster directory's database and the jobs' run directories):

- ``/``: the queue (state, placement, progress, JCT so far, restarts, resizes, deadline and slack)
  and the slots;
- ``/timeline``: the allocation over time, one lane per slot, one bar per (round, job);
- ``/jobs/{id}``: a job's loss curve (from its ``metrics.jsonl``: every step of a small file, at
  most :data:`CURVE_POINTS` points sampled through a large one; log scale by default, a link
  switches to linear), measured throughputs and events (times and fields rendered);
- ``/policy``: the policy in force, round length, emulated slowdowns, recent rounds' decision times;
- ``/api/state``: the same data as JSON.

The HTML pages refresh themselves every ``refresh_s`` seconds (a small inline script replaces
the page's ``<main>``; a checkbox turns it off, and it waits while a form field is filled in).

The only action, ``POST /jobs/{id}/cancel``, needs the cluster's token (the file ``token`` in the
cluster directory, mode 0600) as ``Authorization: Bearer TOKEN`` or a ``token`` form field;
without it the answer is 403 and nothing changes. The server binds to loopback only
(:func:`serve` refuses any other address): reach it from elsewhere through an SSH tunnel.

What a client may not do (invariants; the limits are :class:`~virtualflow.service.webguard.WebLimits`):
name another host (a request whose ``Host`` is not a loopback name of the bound address family
is refused with 400 before anything is read: a DNS-rebinding page cannot read ``/api/state``);
send a body over ``max_body_bytes`` (413, by ``Content-Length`` before reading, or as soon as a
chunked body passes the limit); make a page read a whole metrics file (the curve reads at most
:data:`CURVE_POINTS` small slices of a large one); get a 500 from a job id (any id that is not a
64-bit row id is a 404). Connections, request deadlines and error logging are bounded in
:mod:`virtualflow.service.webguard`.

Why Starlette: a small, well-kept ASGI framework (the core of FastAPI) with no template engine
or ORM to pull in; uvicorn serves it. Both are imported only here, so the rest of virtualflow
does not need them.
"""

from __future__ import annotations

import hmac
import html
import json
import logging
import math
import os
import re
import socket
import time
from typing import Any, Callable

from virtualflow.service.core import slot_names
from virtualflow.service.deadlines import deadline_cells, format_duration
from virtualflow.service.rows import JobRow
from virtualflow.service.state import ClusterDB
from virtualflow.service.webguard import RateLimitedLog, WebLimits, guarded_protocol

LOOPBACK = ("127.0.0.1", "::1", "localhost")
COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
          "#bab0ac")
CURVE_POINTS = 600
"""A loss curve has at most this many points (about one per pixel of its width)."""
WHOLE_FILE_BYTES = 1 << 20
"""A metrics file up to this size is read whole (every step); a larger one is sampled."""
REFRESH_S = 5.0
"""How often the pages refresh themselves by default."""
MAX_ROW_ID = 2**63 - 1
"""SQLite's largest row id: a larger job id cannot exist."""
DEFAULT_JOB_NAME = "job"
"""``Job.name``'s default: a job that keeps it is shown by its file and function instead."""

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse}td,th{padding:.25em .6em;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}
nav a{margin-right:1em}nav label{margin-left:1em;font-size:90%}.state-failed{color:#b00}.state-done{color:#070}
.state-running{color:#05a}.muted{color:#777}.late{color:#b00;font-weight:bold}.fields span{margin-right:.8em}
.fields b{font-weight:normal;color:#555}
"""

# Replaces <main> with a fresh copy every data-refresh-s seconds, unless turned off (remembered in
# localStorage) or a form field is being filled in (a token being typed must not be wiped).
_SCRIPT = """
(function(){
  var box=document.getElementById('autorefresh'), every=1000*parseFloat(document.body.dataset.refreshS);
  box.checked=localStorage.getItem('vf-autorefresh')!=='off';
  box.addEventListener('change',function(){localStorage.setItem('vf-autorefresh',box.checked?'on':'off');});
  setInterval(function(){
    if(!box.checked)return;
    var a=document.activeElement;
    if(a&&a!==box&&(a.tagName==='INPUT'||a.tagName==='BUTTON'))return;
    var filled=Array.prototype.some.call(document.querySelectorAll('main input'),function(i){return i.value;});
    if(filled)return;
    fetch(location.href,{headers:{accept:'text/html'}}).then(function(r){return r.ok?r.text():null;})
      .then(function(t){
        if(t===null)return;
        var m=new DOMParser().parseFromString(t,'text/html').querySelector('main');
        if(m){document.querySelector('main').replaceWith(m);
          document.getElementById('refreshed').textContent='updated '+new Date().toLocaleTimeString();}
      }).catch(function(){});
  },every);
})();
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _page(title: str, body: str, refresh_s: float = REFRESH_S) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)} - virtualflow cluster</title>"
            f"<style>{_STYLE}</style></head><body data-refresh-s='{refresh_s:g}'><nav><a href='/'>queue</a>"
            f"<a href='/timeline'>timeline</a><a href='/policy'>policy</a><label><input type='checkbox' "
            f"id='autorefresh' checked> auto-refresh every {refresh_s:g} s</label> <span id='refreshed' "
            f"class='muted'></span></nav><main><h1>{_e(title)}</h1>{body}</main><script>{_SCRIPT}</script>"
            f"</body></html>")


def _color(job_id: int) -> str:
    return COLORS[job_id % len(COLORS)]


def default_name(target: str) -> str:
    """A job's name when its ``Job.name`` is the default: its file (or module) and function,
    ``"train.py:make_job"`` -> ``"train"``, ``"train.py:resnet"`` -> ``"train:resnet"``."""
    path, _, func = target.rpartition(":") if ":" in target else (target, "", "")
    base = os.path.basename(path) or path
    stem = base[:-3] if base.endswith(".py") else base
    return stem if func in ("", "make_job") else f"{stem}:{func}"


def display_name(row: JobRow) -> str:
    """The name a table shows: the job's own, or (for a job that kept ``Job.name``'s default,
    as rows submitted before names were derived did) its file and function."""
    return row.name if row.name and row.name != DEFAULT_JOB_NAME else default_name(row.target)


def parse_job_id(text: str) -> int | None:
    """A job id from a URL: decimal digits naming a possible SQLite row id, else None (a 404)."""
    if not re.fullmatch(r"[0-9]{1,19}", text):
        return None
    value = int(text)
    return value if value <= MAX_ROW_ID else None


def queue_html(jobs: list[JobRow], slots: dict[str, int], now: float) -> str:
    rows = []
    for j in jobs:
        place = f"{j.workers}x{j.acc_type}" if j.state == "running" and j.acc_type else "-"
        end = j.finished_s if j.finished_s is not None else now
        shape = f"elastic {j.min_workers}-{j.max_workers}" if j.elastic else f"rigid {j.max_workers}"
        loss = "-" if j.loss is None else f"{j.loss:.4g}"
        deadline, slack = deadline_cells(j, now)
        late = " class='late'" if j.deadline_missed or slack.startswith("-") and slack != "-" else ""
        rows.append(f"<tr class='job' data-job='{j.id}'><td><a href='/jobs/{j.id}'>{j.id}</a></td>"
                    f"<td class='name' title='{_e(j.target)}'>{_e(display_name(j))}</td>"
                    f"<td class='state-{_e(j.state)}'>{_e(j.state)}</td><td>{_e(shape)}</td><td>{_e(place)}</td>"
                    f"<td>{j.steps_done}/{j.steps}</td><td>{end - j.submitted_s:.1f}</td><td>{loss}</td>"
                    f"<td>{j.restarts}</td><td>{j.resizes}</td><td>{_e(', '.join(j.slots))}</td>"
                    f"<td class='deadline'>{_e(deadline)}</td><td class='slack'><span{late}>{_e(slack)}</span></td></tr>")
    holders = {s: j.id for j in jobs if j.state == "running" for s in j.slots}
    slot_cells = "".join(f"<td>{_e(s)}: {('job ' + str(holders[s])) if s in holders else 'free'}</td>"
                         for s in slot_names(slots))
    return ("<h2>slots</h2><table id='slots'><tr>" + slot_cells + "</tr></table>"
            "<h2>queue</h2><table id='queue'><tr><th>id</th><th>name</th><th>state</th><th>shape</th><th>placement</th>"
            "<th>progress</th><th>JCT so far (s)</th><th>loss</th><th>restarts</th><th>resizes</th><th>slots</th>"
            "<th>deadline (left)</th><th>slack</th></tr>"
            + "".join(rows) + "</table>" + ("" if jobs else "<p class='muted'>no jobs submitted</p>"))


def _deadline_text(row: JobRow) -> str:
    if row.deadline_s is None:
        return ""
    deadline, slack = deadline_cells(row, time.time())
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.deadline_s))
    return f"; <span id='deadline'>deadline {_e(at)} ({_e(deadline)}), slack {_e(slack)}</span>"


def timeline_svg(allocations: list[dict[str, Any]], slots: dict[str, int], now: float, width: int = 900) -> str:
    """One lane per slot; a bar per (round, job, slot) from the allocation's start to its end."""
    lanes = slot_names(slots)
    lane_h, left, top = 26, 80, 20
    height = top + lane_h * len(lanes) + 30
    if allocations:
        t0 = min(a["start_s"] for a in allocations)
        t1 = max((a["end_s"] if a["end_s"] is not None else now) for a in allocations)
    else:
        t0, t1 = now - 60, now
    span = max(t1 - t0, 1e-6)
    x = lambda t: left + (t - t0) / span * (width - left - 10)  # noqa: E731
    parts = [f"<svg id='timeline' xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>"]
    for i, lane in enumerate(lanes):
        y = top + i * lane_h
        parts.append(f"<text x='4' y='{y + 17}' font-size='12'>{_e(lane)}</text>"
                     f"<line x1='{left}' x2='{width - 10}' y1='{y + lane_h}' y2='{y + lane_h}' stroke='#eee'/>")
    for a in allocations:
        end = a["end_s"] if a["end_s"] is not None else now
        for s in a["slots"]:
            if s not in lanes:
                continue
            y = top + lanes.index(s) * lane_h + 3
            x0, x1 = x(a["start_s"]), x(end)
            parts.append(f"<rect class='alloc' data-job='{a['job_id']}' data-slot='{_e(s)}' x='{x0:.1f}' y='{y}' "
                         f"width='{max(x1 - x0, 1):.1f}' height='{lane_h - 6}' fill='{_color(a['job_id'])}'>"
                         f"<title>job {a['job_id']} round {a['round']} ({_e(a['change'])})</title></rect>"
                         f"<text x='{x0 + 3:.1f}' y='{y + 14}' font-size='11' fill='#fff'>{a['job_id']}</text>")
    parts.append(f"<text x='{left}' y='{height - 8}' font-size='11' class='muted'>0 s</text>"
                 f"<text x='{width - 60}' y='{height - 8}' font-size='11'>{span:.0f} s</text></svg>")
    return "".join(parts)


def _ticks(lo: float, hi: float, log_scale: bool) -> list[float]:
    """Axis ticks within [lo, hi]: decades (with 2 and 5 when the range spans few) on a log axis,
    about five round numbers on a linear one."""
    if hi <= lo:
        return [lo]
    if log_scale:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        steps = (1.0,) if b - a > 3 else (1.0, 2.0, 5.0)
        ticks = [m * 10.0**k for k in range(a, b + 1) for m in steps]
    else:
        raw = (hi - lo) / 4
        mag = 10.0 ** math.floor(math.log10(raw))
        step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
        ticks = [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
    eps = 1e-9 * max(abs(lo), abs(hi))
    return [t for t in ticks if lo - eps <= t <= hi + eps] or [lo, hi]


def curve_svg(points: list[tuple[float, float]], *, width: int = 600, height: int = 240, label: str = "",
              scale: str = "log") -> str:
    """A polyline of ``points`` with y gridlines; ``scale="log"`` plots log10(y) (only when every
    y is positive: otherwise the curve is linear and says so). The ``<svg>`` carries
    ``data-scale`` (the scale drawn) and ``data-points`` (how many points)."""
    if not points:
        return "<p class='muted'>no records yet</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    note = ""
    if scale == "log" and min(ys) <= 0:
        scale, note = "linear", "<p class='muted'>linear scale: the loss is not always positive</p>"
    log_scale = scale == "log"
    f = (lambda v: math.log10(v)) if log_scale else (lambda v: v)  # noqa: E731
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    left, bottom, top = 60, 25, 10
    sx = (width - left - 10) / max(x1 - x0, 1e-9)
    fy0, fy1 = f(y0), f(y1)
    sy = (height - bottom - top) / max(fy1 - fy0, 1e-12)
    ypix = lambda v: height - bottom - (f(v) - fy0) * sy  # noqa: E731
    path = " ".join(f"{left + (px - x0) * sx:.1f},{ypix(py):.1f}" for px, py in points)
    grid = "".join(f"<line x1='{left}' x2='{width - 10}' y1='{ypix(t):.1f}' y2='{ypix(t):.1f}' stroke='#eee'/>"
                   f"<text class='tick' x='{left - 4}' y='{ypix(t) + 4:.1f}' font-size='11' text-anchor='end'>"
                   f"{t:.3g}</text>" for t in _ticks(y0, y1, log_scale))
    return (f"{note}<svg class='curve' data-scale='{scale}' data-points='{len(points)}' "
            f"xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>{grid}"
            f"<polyline fill='none' stroke='#4e79a7' stroke-width='1.5' points='{path}'/>"
            f"<text x='{left}' y='{height - 5}' font-size='11'>{_e(label)} {x0:g} .. {x1:g}"
            f"{' (log scale)' if log_scale else ''}</text></svg>")


def _loss_record(line: bytes) -> tuple[int, float] | None:
    try:
        r = json.loads(line)
    except ValueError:
        return None
    if isinstance(r, dict) and isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float)) \
            and not isinstance(r.get("loss"), bool) and math.isfinite(r["loss"]):
        return r["step"], float(r["loss"])
    return None


def read_losses(run_dir: str, *, max_points: int = CURVE_POINTS,
                whole_bytes: int = WHOLE_FILE_BYTES) -> list[tuple[float, float]]:
    """(step, loss) of a job's ``metrics.jsonl``, sorted by step (malformed lines skipped).

    A file of at most ``whole_bytes`` is read whole: every step. A larger one is sampled: the
    first whole record after each of ``max_points`` evenly spaced offsets, and the last record,
    so a request reads about ``max_points`` small slices whatever the file's size (a 300k-step
    file is not parsed per page view)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    out: dict[int, float] = {}
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= whole_bytes:
                for line in f:
                    if (rec := _loss_record(line)) is not None:
                        out[rec[0]] = rec[1]
                return sorted(out.items())
            slice_bytes = 2048
            for k in range(max_points):
                offset = k * size // max_points
                f.seek(offset)
                lines = f.read(slice_bytes).split(b"\n")
                # The first piece is the tail of a line cut by the offset (or the file's first line)
                # and the last one may be cut by the slice: only whole lines in between are read.
                for line in lines[(0 if offset == 0 else 1):-1]:
                    if (rec := _loss_record(line)) is not None:
                        out[rec[0]] = rec[1]
                        break
            f.seek(max(size - 16 * slice_bytes, 0))
            for line in reversed(f.read().split(b"\n")[1:]):
                if (rec := _loss_record(line)) is not None:
                    out[rec[0]] = rec[1]
                    break
    except OSError:
        return []
    return sorted(out.items())


def _field(key: str, value: Any) -> str:
    """One field of an event, for people: epoch times as local times, other ``*_s`` as durations."""
    if isinstance(value, bool) or value is None:
        text = str(value).lower()
    elif isinstance(value, (int, float)) and key.endswith("_s") and not key.endswith("per_s") \
            and math.isfinite(value):
        text = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value)) if value > 1e9
                else f"{value:.3g} s" if abs(value) < 60 else format_duration(value))
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, list):
        text = ", ".join(str(v) for v in value)
    elif isinstance(value, dict):
        text = ", ".join(f"{k}={v}" for k, v in value.items())
    else:
        text = str(value)
    if len(text) > 300:
        text = text[:300] + "..."
    return f"<span><b>{_e(key.replace('_', ' '))}</b> {_e(text)}</span>"


def event_fields(data: Any) -> str:
    """An event's data as ``key value`` pairs (HTML), not raw JSON."""
    if not isinstance(data, dict):
        return _e(str(data)[:300])
    return "".join(_field(str(k), v) for k, v in data.items())



def _host_name(header: str) -> str:
    """The name in a ``Host`` header, port and brackets kept apart: ``"[::1]:8266"`` -> ``"[::1]"``."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() else host


def allowed_hosts(server_host: str) -> tuple[str, ...]:
    """The ``Host`` names a dashboard bound to ``server_host`` answers to: the loopback address
    itself and ``localhost`` (through an SSH tunnel the browser still says one of these)."""
    return ("[::1]", "localhost") if ":" in server_host else ("127.0.0.1", "localhost")


def refuse_request(scope: dict[str, Any], limits: WebLimits) -> tuple[int, str] | None:
    """Why a request is refused before the application sees it, as (status, text), or None.

    ``Host`` must be a loopback name of the bound address (DNS rebinding gives a page another
    site's name for 127.0.0.1: such requests are 400); a declared ``Content-Length`` must be a
    number no larger than ``limits.max_body_bytes`` (413). Pure: reads ``scope`` only."""
    headers: dict[bytes, list[bytes]] = {}
    for k, v in scope.get("headers", []):
        headers.setdefault(k.lower(), []).append(v)
    server = scope.get("server") or ("127.0.0.1", 0)
    allowed = allowed_hosts(str(server[0]))
    hosts = headers.get(b"host", [])
    host = hosts[0].decode("latin-1") if len(hosts) == 1 else ""
    if _host_name(host) not in allowed:
        shown = host if len(host) <= 80 else host[:80] + "..."
        return 400, (f"refused: Host {shown!r} is not this dashboard's; it answers to {' or '.join(allowed)} only "
                     f"(with any port, e.g. through ssh -L)")
    lengths = headers.get(b"content-length", [])
    if lengths:
        text = lengths[0].decode("latin-1").strip()
        if len(lengths) > 1 or not text.isdigit():
            return 400, "refused: the Content-Length header must be one number"
        if int(text) > limits.max_body_bytes:
            return 413, f"refused: a body of {int(text)} bytes; the dashboard takes at most {limits.max_body_bytes}"
    return None


async def read_body(request: Any, limit: int) -> bytes | None:
    """The request's body, or None once it passes ``limit`` bytes (the rest is never read: a
    chunked body has no ``Content-Length`` to refuse it by)."""
    from starlette.requests import ClientDisconnect

    chunks, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                return None
            chunks.append(chunk)
    except ClientDisconnect:
        return b""
    return b"".join(chunks)


def make_app(cluster_dir: str, *, limits: WebLimits | None = None, refresh_s: float = REFRESH_S) -> Any:
    """The ASGI application of ``cluster_dir``'s dashboard (Starlette, behind :func:`refuse_request`)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
    from starlette.routing import Route

    limits = limits or WebLimits()
    if not (math.isfinite(refresh_s) and refresh_s > 0):
        raise ValueError(f"refresh_s={refresh_s!r} must be a positive number of seconds")
    token_path = os.path.join(cluster_dir, "token")

    def db() -> ClusterDB:
        return ClusterDB(cluster_dir)

    def page(title: str, body: str, status_code: int = 200) -> HTMLResponse:
        return HTMLResponse(_page(title, body, refresh_s), status_code=status_code)

    def no_job(text: str) -> HTMLResponse:
        return page("no such job", f"<p>job {_e(text[:40])} does not exist</p>", status_code=404)

    def index(request: Request) -> HTMLResponse:
        d = db()
        try:
            cfg, jobs = d.config(), d.jobs()
            svc = d.get_meta("service") or {}
        finally:
            d.close()
        age = time.time() - float(svc.get("heartbeat_s") or 0)
        state = (f"service {svc.get('state', 'never started')}, pid {svc.get('pid')}, heartbeat {age:.0f} s ago"
                 if svc else "service never started")
        body = (f"<p id='service'>{_e(state)}; policy <b>{_e(cfg['policy'])}</b>, rounds of {cfg['round_s']:g} s</p>"
                + queue_html(jobs, cfg["slots"], time.time()))
        return page("cluster queue", body)

    def timeline(request: Request) -> HTMLResponse:
        d = db()
        try:
            cfg, allocs, jobs = d.config(), d.allocations(), {j.id: j for j in d.jobs()}
        finally:
            d.close()
        body = timeline_svg(allocs, cfg["slots"], time.time())
        legend = "".join(f"<span style='color:{_color(j)}'>&#9632; job {j}"
                         f"{' ' + _e(display_name(jobs[j])) if j in jobs else ''}</span> "
                         for j in sorted({a["job_id"] for a in allocs}))
        return page("allocation timeline", body + f"<p>{legend}</p>")

    def job_page(request: Request) -> HTMLResponse:
        jid = parse_job_id(request.path_params["job_id"])
        if jid is None:
            return no_job(request.path_params["job_id"])
        d = db()
        try:
            row = d.job(jid)
            events = d.events(job_id=jid)
        finally:
            d.close()
        if row is None:
            return no_job(str(jid))
        thr = [e for e in events if e["kind"] == "throughput"]
        thr_rows = "".join(f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(e['t']))}</td>"
                           f"<td>{_e(e['data'].get('workers'))}x{_e(e['data'].get('acc_type'))}</td>"
                           f"<td>{float(e['data'].get('steps_per_s') or 0):.3f}</td></tr>" for e in thr)
        shown = events[-200:]  # the newest: a long-running job has one throughput event per round
        ev_rows = "".join(f"<tr><td>{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['t']))}</td>"
                          f"<td>{_e(e['kind'])}</td><td class='fields'>{event_fields(e['data'])}</td></tr>"
                          for e in shown)
        more = (f"<p class='muted'>the newest {len(shown)} of {len(events)} events</p>"
                if len(events) > len(shown) else "")
        est = "".join(f"<tr><td>{_e(k)}</td><td>{v:.3f}</td></tr>" for k, v in sorted(row.estimates.items()))
        form = ("" if row.final else
                f"<form id='cancel' method='post' action='/jobs/{jid}/cancel'><label>token <input type='password' "
                f"name='token' autocomplete='off'></label> <button type='submit'>cancel job {jid}</button></form>")
        points = read_losses(row.run_dir) if row.run_dir else []
        asked = request.query_params.get("scale")
        scale = asked if asked in ("log", "linear") else ("log" if points and min(p[1] for p in points) > 0
                                                           else "linear")
        toggle = " | ".join(f"<b>{s}</b>" if s == scale else f"<a href='/jobs/{jid}?scale={s}' id='scale-{s}'>{s}</a>"
                            for s in ("log", "linear"))
        body = (f"{form}<p>{_e(row.target)}: <b class='state-{_e(row.state)}'>{_e(row.state)}</b>, step "
                f"{row.steps_done}/{row.steps}{'; error: ' + _e(row.error) if row.error else ''}{_deadline_text(row)}"
                f"</p><h2>loss</h2><p class='muted'>scale: {toggle}</p>{curve_svg(points, label='step', scale=scale)}"
                f"<h2>measured throughput (steps/s)</h2><table id='throughput'><tr><th>time</th><th>placement</th>"
                f"<th>steps/s</th></tr>{thr_rows}</table><h2>estimates</h2><table><tr><th>type/workers</th>"
                f"<th>steps/s</th></tr>{est}</table><h2>events</h2>{more}<table id='events'><tr><th>time</th>"
                f"<th>event</th><th>details</th></tr>{ev_rows}</table>")
        return page(f"job {jid} ({display_name(row)})", body)

    def policy(request: Request) -> HTMLResponse:
        d = db()
        try:
            cfg, rounds = d.config(), d.rounds(limit=50)
        finally:
            d.close()
        from virtualflow.service.core import type_slowdowns
        from virtualflow.service.tables import gavel_table

        slow = type_slowdowns(tuple(cfg["slots"]), gavel_table(), cfg.get("slowdowns") or {})
        rr = "".join(f"<tr><td>{r['id']}</td><td>{r['active']}</td><td>{r['placed']}</td>"
                     f"<td>{'yes' if r['solved'] else ''}</td><td>{r['decision_s'] * 1000:.1f}</td></tr>"
                     for r in reversed(rounds))
        body = (f"<p id='policy'>policy <b>{_e(cfg['policy'])}</b> (the same code as virtualflow simulate), rounds of "
                f"{cfg['round_s']:g} s</p><h2>emulated accelerator types</h2><table><tr><th>type</th><th>slots</th>"
                f"<th>slowdown</th></tr>"
                + "".join(f"<tr><td>{_e(t)}</td><td>{n}</td><td>{slow[t]:.2f}</td></tr>" for t, n in cfg["slots"].items())
                + "</table><h2>recent rounds</h2><table><tr><th>round</th><th>active jobs</th><th>placed</th>"
                  "<th>re-solved</th><th>decision ms</th></tr>" + rr + "</table>")
        return page("policy", body)

    def api_state(request: Request) -> JSONResponse:
        d = db()
        try:
            cfg, jobs, allocs = d.config(), d.jobs(), d.allocations()
            svc = d.get_meta("service") or {}
        finally:
            d.close()
        return JSONResponse({"config": cfg, "service": svc, "allocations": allocs,
                             "jobs": [{k: getattr(j, k) for k in JobRow.__slots__} for j in jobs]})  # type: ignore

    async def cancel(request: Request) -> Any:
        jid = parse_job_id(request.path_params["job_id"])
        given = request.headers.get("authorization", "")
        given = given[7:] if given.lower().startswith("bearer ") else ""
        if not given:  # an HTML form (application/x-www-form-urlencoded), parsed here: no multipart dependency
            from urllib.parse import parse_qs

            body = await read_body(request, limits.max_body_bytes)
            if body is None:
                return PlainTextResponse(f"refused: the body passed {limits.max_body_bytes} bytes", status_code=413)
            given = (parse_qs(body.decode("utf-8", "replace")).get("token") or [""])[0]
        try:
            with open(token_path) as f:
                token = f.read().strip()
        except OSError:
            token = ""
        if not token or not given or not hmac.compare_digest(given.encode(), token.encode()):
            return PlainTextResponse("forbidden: cancelling needs the cluster's token (the file token in the "
                                     "cluster directory)", status_code=403)
        if jid is None:
            return PlainTextResponse(f"job {request.path_params['job_id'][:40]} does not exist", status_code=404)
        d = db()
        try:
            what = d.request_cancel(jid)
        except ValueError as exc:
            return PlainTextResponse(str(exc), status_code=404)
        finally:
            d.close()
        if "text/html" in request.headers.get("accept", ""):
            return RedirectResponse(f"/jobs/{jid}", status_code=303)
        return JSONResponse({"job": jid, "result": what})

    app = Starlette(routes=[
        Route("/", index), Route("/timeline", timeline), Route("/policy", policy),
        Route("/jobs/{job_id}", job_page), Route("/api/state", api_state),
        Route("/jobs/{job_id}/cancel", cancel, methods=["POST"]),
    ])

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        refusal = refuse_request(scope, limits) if scope["type"] == "http" else None
        if refusal is None:
            await app(scope, receive, send)
            return
        status, text = refusal
        await PlainTextResponse(text, status_code=status, headers={"connection": "close"})(scope, receive, send)

    return guarded


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket on a loopback address (anything else is refused)."""
    if host not in LOOPBACK:
        raise ValueError(f"the dashboard binds to loopback only (127.0.0.1 or ::1), not {host!r}; reach it from "
                         f"another machine through an SSH tunnel (ssh -L PORT:127.0.0.1:PORT)")
    family = socket.AF_INET6 if host == "::1" else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1" if host == "localhost" else host, port))
    sock.listen(64)  # what waits to be accepted waits in the kernel, not as this process's descriptors
    return sock


def make_server(cluster_dir: str, *, limits: WebLimits | None = None, refresh_s: float = REFRESH_S) -> Any:
    """The uvicorn server of ``cluster_dir``'s dashboard, with ``limits`` (see
    :mod:`virtualflow.service.webguard`); run it with ``server.run(sockets=[bind(...)])``."""
    import uvicorn

    limits = limits or WebLimits()
    errors = RateLimitedLog(logging.getLogger("uvicorn.error"), burst=limits.error_log_burst,
                            window_s=limits.error_log_window_s)
    config = uvicorn.Config(make_app(cluster_dir, limits=limits, refresh_s=refresh_s), log_level="warning",
                            lifespan="off", http=guarded_protocol(limits, errors),
                            timeout_keep_alive=limits.keep_alive_s, backlog=limits.backlog,
                            h11_max_incomplete_event_size=limits.max_header_bytes)
    return uvicorn.Server(config)


def serve(cluster_dir: str, *, host: str = "127.0.0.1", port: int = 0,
          announce: Callable[[str], None] | None = None) -> None:
    """Serve the dashboard until interrupted."""
    sock = bind(host, port)
    url = f"http://{host if ':' not in host else '[' + host + ']'}:{sock.getsockname()[1]}/"
    if announce is not None:
        announce(url)
    make_server(cluster_dir).run(sockets=[sock])
