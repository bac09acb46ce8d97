"""The cluster service's web dashboard: Starlette on loopback, server-rendered HTML and SVG.

Pages (all read-only, from the cluster directory's database and the jobs' run directories):

- ``/``: the queue (state, placement, progress, JCT so far, restarts, resizes, deadline and slack)
  and the slots;
- ``/timeline``: the allocation over time, one lane per slot, one bar per (round, job);
- ``/jobs/{id}``: a job's loss curve (its ``metrics.jsonl``), measured throughputs and events;
- ``/policy``: the policy in force, round length, emulated slowdowns, recent rounds' decision times;
- ``/api/state``: the same data as JSON.

The only action, ``POST /jobs/{id}/cancel``, needs the cluster's token (the file ``token`` in the
cluster directory, mode 0600) as ``Authorization: Bearer TOKEN`` or a ``token`` form field;
without it the answer is 403 and nothing changes. The server binds to loopback only
(:func:`serve` refuses any other address): reach it from elsewhere through an SSH tunnel.

Why Starlette: a small, well-kept ASGI framework (the core of FastAPI) with no template engine
or ORM to pull in; uvicorn serves it. Both are imported only here, so the rest of virtualflow
does not need them.
"""

from __future__ import annotations

import hmac
import html
import json
import os
import socket
import time
from typing import Any, Callable

from virtualflow.service.core import slot_names
from virtualflow.service.deadlines import deadline_cells
from virtualflow.service.state import ClusterDB, JobRow

LOOPBACK = ("127.0.0.1", "::1", "localhost")
COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
          "#bab0ac")

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse}td,th{padding:.25em .6em;border-bottom:1px solid #ddd;text-align:left}
nav a{margin-right:1em}.state-failed{color:#b00}.state-done{color:#070}.state-running{color:#05a}
.muted{color:#777}.late{color:#b00;font-weight:bold}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)} - virtualflow cluster</title>"
            f"<style>{_STYLE}</style></head><body><nav><a href='/'>queue</a><a href='/timeline'>timeline</a>"
            f"<a href='/policy'>policy</a></nav><h1>{_e(title)}</h1>{body}</body></html>")


def _color(job_id: int) -> str:
    return COLORS[job_id % len(COLORS)]


def queue_html(jobs: list[JobRow], slots: dict[str, int], now: float) -> str:
    rows = []
    for j in jobs:
        place = f"{j.workers}x{j.acc_type}" if j.state == "running" and j.acc_type else "-"
        end = j.finished_s if j.finished_s is not None else now
        shape = f"elastic {j.min_workers}-{j.max_workers}" if j.elastic else f"rigid {j.max_workers}"
        loss = "-" if j.loss is None else f"{j.loss:.4g}"
        deadline, slack = deadline_cells(j, now)
        late = " class='late'" if j.deadline_missed or slack.startswith("-") and slack != "-" else ""
        rows.append(f"<tr class='job' data-job='{j.id}'><td><a href='/jobs/{j.id}'>{j.id}</a></td><td>{_e(j.name)}</td>"
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


def curve_svg(points: list[tuple[float, float]], *, width: int = 600, height: int = 220, label: str = "") -> str:
    if not points:
        return "<p class='muted'>no records yet</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (width - 60) / max(x1 - x0, 1e-9)
    sy = (height - 40) / max(y1 - y0, 1e-9)
    path = " ".join(f"{50 + (px - x0) * sx:.1f},{height - 25 - (py - y0) * sy:.1f}" for px, py in points)
    return (f"<svg class='curve' xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>"
            f"<polyline fill='none' stroke='#4e79a7' stroke-width='1.5' points='{path}'/>"
            f"<text x='2' y='14' font-size='11'>{y1:.4g}</text><text x='2' y='{height - 25}' font-size='11'>{y0:.4g}"
            f"</text><text x='50' y='{height - 5}' font-size='11'>{_e(label)} {x0:g} .. {x1:g}</text></svg>")


def read_losses(run_dir: str) -> list[tuple[float, float]]:
    """(step, loss) of a job's ``metrics.jsonl`` (malformed lines skipped)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    out: dict[int, float] = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if isinstance(r, dict) and isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float)):
                    out[r["step"]] = float(r["loss"])
    except OSError:
        return []
    return sorted(out.items())


def make_app(cluster_dir: str) -> Any:
    """The Starlette application of ``cluster_dir``'s dashboard."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
    from starlette.routing import Route

    token_path = os.path.join(cluster_dir, "token")

    def db() -> ClusterDB:
        return ClusterDB(cluster_dir)

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
        return HTMLResponse(_page("cluster queue", body))

    def timeline(request: Request) -> HTMLResponse:
        d = db()
        try:
            cfg, allocs = d.config(), d.allocations()
        finally:
            d.close()
        body = timeline_svg(allocs, cfg["slots"], time.time())
        legend = "".join(f"<span style='color:{_color(j)}'>&#9632; job {j}</span> "
                         for j in sorted({a["job_id"] for a in allocs}))
        return HTMLResponse(_page("allocation timeline", body + f"<p>{legend}</p>"))

    def job_page(request: Request) -> HTMLResponse:
        jid = int(request.path_params["job_id"])
        d = db()
        try:
            row = d.job(jid)
            events = d.events(job_id=jid)
        finally:
            d.close()
        if row is None:
            return HTMLResponse(_page("no such job", f"<p>job {jid} does not exist</p>"), status_code=404)
        thr = [e for e in events if e["kind"] == "throughput"]
        thr_rows = "".join(f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(e['t']))}</td>"
                           f"<td>{_e(e['data'].get('workers'))}x{_e(e['data'].get('acc_type'))}</td>"
                           f"<td>{float(e['data'].get('steps_per_s') or 0):.3f}</td></tr>" for e in thr)
        ev_rows = "".join(f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(e['t']))}</td><td>{_e(e['kind'])}</td>"
                          f"<td class='muted'>{_e(json.dumps(e['data']))[:300]}</td></tr>" for e in events)
        est = "".join(f"<tr><td>{_e(k)}</td><td>{v:.3f}</td></tr>" for k, v in sorted(row.estimates.items()))
        form = ("" if row.final else
                f"<form id='cancel' method='post' action='/jobs/{jid}/cancel'><label>token <input type='password' "
                f"name='token' autocomplete='off'></label> <button type='submit'>cancel job {jid}</button></form>")
        body = (f"{form}<p>{_e(row.target)}: <b class='state-{_e(row.state)}'>{_e(row.state)}</b>, step {row.steps_done}/"
                f"{row.steps}{'; error: ' + _e(row.error) if row.error else ''}{_deadline_text(row)}</p>"
                f"<h2>loss</h2>{curve_svg(read_losses(row.run_dir), label='step')}"
                f"<h2>measured throughput (steps/s)</h2><table id='throughput'><tr><th>time</th><th>placement</th>"
                f"<th>steps/s</th></tr>{thr_rows}</table><h2>estimates</h2><table><tr><th>type/workers</th>"
                f"<th>steps/s</th></tr>{est}</table><h2>events</h2><table>{ev_rows}</table>")
        return HTMLResponse(_page(f"job {jid} ({row.name})", body))

    def policy(request: Request) -> HTMLResponse:
        d = db()
        try:
            cfg, rounds = d.config(), d.rounds(limit=50)
        finally:
            d.close()
        from virtualflow.service.runner import gavel_table
        from virtualflow.service.core import type_slowdowns

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
        return HTMLResponse(_page("policy", body))

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
        given = request.headers.get("authorization", "")
        given = given[7:] if given.lower().startswith("bearer ") else ""
        if not given:  # an HTML form (application/x-www-form-urlencoded), parsed here: no multipart dependency
            from urllib.parse import parse_qs

            body = (await request.body())[:4096].decode("utf-8", "replace")
            given = (parse_qs(body).get("token") or [""])[0]
        try:
            with open(token_path) as f:
                token = f.read().strip()
        except OSError:
            token = ""
        if not token or not given or not hmac.compare_digest(given.encode(), token.encode()):
            return PlainTextResponse("forbidden: cancelling needs the cluster's token (the file token in the "
                                     "cluster directory)", status_code=403)
        jid = int(request.path_params["job_id"])
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

    return Starlette(routes=[
        Route("/", index), Route("/timeline", timeline), Route("/policy", policy),
        Route("/jobs/{job_id:int}", job_page), Route("/api/state", api_state),
        Route("/jobs/{job_id:int}/cancel", cancel, methods=["POST"]),
    ])


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket on a loopback address (anything else is refused)."""
    if host not in LOOPBACK:
        raise ValueError(f"the dashboard binds to loopback only (127.0.0.1 or ::1), not {host!r}; reach it from "
                         f"another machine through an SSH tunnel (ssh -L PORT:127.0.0.1:PORT)")
    family = socket.AF_INET6 if host == "::1" else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1" if host == "localhost" else host, port))
    sock.listen(64)
    return sock


def make_server(cluster_dir: str) -> Any:
    import uvicorn

    return uvicorn.Server(uvicorn.Config(make_app(cluster_dir), log_level="warning", lifespan="off"))


def serve(cluster_dir: str, *, host: str = "127.0.0.1", port: int = 0,
          announce: Callable[[str], None] | None = None) -> None:
    """Serve the dashboard until interrupted."""
    sock = bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}/"
    if announce is not None:
        announce(url)
    make_server(cluster_dir).run(sockets=[sock])
