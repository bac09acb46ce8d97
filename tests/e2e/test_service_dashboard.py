"""The cluster dashboard in a real headless Chromium (the OS's /usr/bin/chromium, driven by
Playwright; scripts/test.sh installs the Debian package when it is missing; the test fails,
never skips, without it): the queue, the timeline, a job's loss curve (log scale, a linear
toggle), its events rendered for people, the policy page, the pages refreshing themselves (and
not while off, nor while a token is being typed), and the one action (cancel), refused without
the cluster's token.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from virtualflow.service.dashboard import bind, make_server
from virtualflow.service.runner import init_cluster
from virtualflow.service.state import ClusterDB

CHROMIUM = "/usr/bin/chromium"
REFRESH_S = 0.4
EPOCH_FIELD = 1764000000.0  # an event field holding a time (seconds since the epoch)
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]


def seconds(text: str) -> int:
    """``"59m57s"`` / ``"1h00m"`` (the dashboard's durations) -> seconds."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([dhms])", text))


@pytest.fixture
def cluster(tmp_path):
    """A cluster directory with a history: a done job that moved between types, a running elastic
    job that was resized, a queued one and a failed one."""
    d = str(tmp_path / "c")
    db = init_cluster(d, slots={"v100": 2, "k80": 1}, policy="elastic_fair", round_s=5.0)
    kw = dict(target="/x/job.py:make", deterministic=True, checkpoint_every=5, priority=1.0, job_type=None)
    a = db.add_job(name="resnet", steps=30, elastic=False, min_workers=1, max_workers=1, now=100.0,
                   deadline_s=120.0, **kw)
    b = db.add_job(name="bert-elastic", steps=40, elastic=True, min_workers=1, max_workers=2, now=101.0,
                   deadline_s=time.time() + 3600, **kw)
    c = db.add_job(name="waiting", steps=40, elastic=False, min_workers=1, max_workers=1, now=102.0,
                   deadline_s=105.0, **kw)
    # A job that kept Job.name's default (as every job submitted before names were derived did).
    f = db.add_job(name="job", steps=40, elastic=False, min_workers=1, max_workers=1, now=102.0,
                   **dict(kw, target="/x/crash.py:make_job"))
    plan = [[(a, "k80", ["k80-0"], "start"), (b, "v100", ["v100-0", "v100-1"], "start")],
            [(a, "v100", ["v100-1"], "move"), (b, "v100", ["v100-0"], "resize")],
            [(b, "v100", ["v100-0", "v100-1"], "resize")]]
    for i, placements in enumerate(plan):
        rid = db.add_round(start_s=103.0 + 5 * i, policy="elastic_fair", solved=i == 0, decision_s=0.002, active=3,
                           placements=[{"job_id": j, "acc_type": t, "workers": len(s), "slots": s, "change": ch}
                                       for j, t, s, ch in placements])
        db.end_round(rid, 108.0 + 5 * i)
    db.set_job_state(a, "done", event="done", finished_s=113.0, steps_done=30, loss=0.12)
    db.set_job_state(b, "running", event="start", acc_type="v100", workers=2, slots=["v100-0", "v100-1"],
                     steps_done=17, loss=0.4)
    db.event("throughput", b, acc_type="v100", workers=2, steps_per_s=3.25)
    db.event("deadline_missed", b, deadline_s=EPOCH_FIELD, late_s=12.5)
    db.update_job(b, eta_s=600.0)
    db.update_job(c, deadline_missed=True, eta_s=40.0)
    db.set_job_state(f, "failed", event="failed", error="TrainingError: boom at index 17")
    run_dir = db.job(a).run_dir
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as out:
        for step in range(30):
            out.write(json.dumps({"step": step, "loss": 1.0 / (1 + step)}) + "\n")
        out.write("{truncated\n")
    db.close()
    return d, {"a": a, "b": b, "c": c, "f": f}


@pytest.fixture
def dashboard(cluster):
    d, ids = cluster
    sock = bind("127.0.0.1", 0)
    server = make_server(d, refresh_s=REFRESH_S)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.05)
    yield d, ids, url
    server.should_exit = True
    thread.join(10)


def test_pages_in_headless_chromium(dashboard):
    d, ids, url = dashboard
    assert os.path.exists(CHROMIUM), (f"{CHROMIUM} is missing: install the OS package (apt-get install -y chromium; "
                                      f"scripts/test.sh does it as root)")
    from playwright.sync_api import sync_playwright

    with open(os.path.join(d, "token")) as f:
        token = f.read().strip()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            rows = page.locator("table#queue tr.job")
            assert rows.count() == 4
            assert "bert-elastic" in rows.nth(1).inner_text() and "2xv100" in rows.nth(1).inner_text()
            assert "failed" in rows.nth(3).inner_text()
            assert rows.nth(3).locator("td.name").inner_text() == "crash"  # Job.name's default: its file
            # Deadlines: met by 7 s (done at 113, due at 120); 1 h left with 50 min of slack; missed.
            deadline = lambda i: rows.nth(i).locator("td.deadline").inner_text()  # noqa: E731
            slack = lambda i: rows.nth(i).locator("td.slack").inner_text()  # noqa: E731
            assert (deadline(0), slack(0)) == ("met 7s", "-")
            left, spare = seconds(deadline(1)), seconds(slack(1))  # rendered a few seconds after the fixture
            assert 3300 < left <= 3600 and spare == left - 600
            assert deadline(2) == "missed" and slack(2).startswith("-")
            assert rows.nth(2).locator("td.slack .late").count() == 1 and (deadline(3), slack(3)) == ("-", "-")
            assert "elastic_fair" in page.locator("#service").inner_text()
            assert "v100-0: job 2" in page.locator("table#slots").inner_text()
            page.click("text=timeline")
            page.wait_for_load_state("load")  # the click waits for the navigation to start, not to finish
            assert page.url == url + "/timeline"
            bars = page.locator("svg#timeline rect.alloc")
            assert bars.count() == 2 + 1 + 1 + 1 + 2  # one bar per (round, job, slot)
            assert page.locator("svg#timeline rect.alloc[data-slot='k80-0']").count() == 1
            assert page.locator("svg#timeline rect.alloc[data-job='2']").count() == 5
            page.goto(url + f"/jobs/{ids['a']}")
            points = page.locator("svg.curve polyline").get_attribute("points")
            assert len(points.split()) == 30  # the loss curve: every step, the truncated line skipped
            # Log scale by default (the loss falls from 1 to 1/30): gridlines at 1-2-5 steps of decades.
            assert page.locator("svg.curve").get_attribute("data-scale") == "log"
            ticks = page.locator("svg.curve text.tick").all_text_contents()
            assert ticks == ["0.05", "0.1", "0.2", "0.5", "1"], ticks
            page.click("#scale-linear")
            assert page.locator("svg.curve").get_attribute("data-scale") == "linear"
            assert len(page.locator("svg.curve polyline").get_attribute("points").split()) == 30
            assert "0.5" in page.locator("svg.curve text.tick").all_text_contents()
            page.goto(url + f"/jobs/{ids['b']}")
            assert "3.250" in page.locator("table#throughput").inner_text()
            events = page.locator("table#events").inner_text()
            assert "{" not in events and "steps per s 3.25" in events  # fields, not raw JSON
            assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(EPOCH_FIELD)) in events
            assert "late s 12.5 s" in events and str(int(EPOCH_FIELD)) not in events
            page.goto(url + f"/jobs/{ids['f']}")
            assert page.title().startswith(f"job {ids['f']} (crash)")  # its file (make_job: the default function)
            page.goto(url + "/policy")
            assert "elastic_fair" in page.locator("#policy").inner_text()
            # The pages refresh themselves ...
            page.goto(url + "/")
            assert page.locator("#autorefresh").is_checked()
            progress = lambda: page.locator("table#queue tr.job").nth(2).locator("td").nth(5).inner_text()  # noqa
            assert progress() == "0/40"
            db = ClusterDB(d)
            db.update_job(ids["c"], steps_done=7)
            page.wait_for_function("() => document.querySelectorAll('table#queue tr.job')[2]"
                                   ".children[5].textContent === '7/40'", timeout=10000)
            # ... not when turned off (remembered across loads) ...
            page.uncheck("#autorefresh")
            db.update_job(ids["c"], steps_done=9)
            time.sleep(4 * REFRESH_S)
            assert progress() == "7/40"
            page.reload()
            assert progress() == "9/40" and not page.locator("#autorefresh").is_checked()
            page.check("#autorefresh")
            # ... and not while a token is being typed (a refresh would wipe it).
            page.goto(url + f"/jobs/{ids['c']}")
            page.fill("#cancel input[name=token]", "half-typed")
            page.locator("h1").click()  # the field loses focus but keeps its text
            db.update_job(ids["c"], steps_done=11)
            time.sleep(4 * REFRESH_S)
            assert page.input_value("#cancel input[name=token]") == "half-typed"
            assert "step 9/40" in page.locator("main p").nth(0).inner_text()
            db.close()
            # The one action needs the token: refused without it, done with it.
            page.goto(url + f"/jobs/{ids['c']}")
            page.fill("#cancel input[name=token]", "not-the-token")
            page.click("#cancel button")
            assert "forbidden" in page.content()
            page.goto(url + f"/jobs/{ids['c']}")
            page.fill("#cancel input[name=token]", token)
            page.click("#cancel button")
            page.wait_for_url(url + f"/jobs/{ids['c']}")
            assert "cancelled" in page.locator("b").first.inner_text()
        finally:
            browser.close()


def test_read_only_without_the_token_and_loopback_only(dashboard):
    d, ids, url = dashboard
    req = urllib.request.Request(url + f"/jobs/{ids['b']}/cancel", method="POST",
                                 headers={"Authorization": "Bearer wrong"})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 403
    state = json.load(urllib.request.urlopen(url + "/api/state", timeout=10))
    assert [j["state"] for j in state["jobs"]] == ["done", "running", "queued", "failed"]
    with open(os.path.join(d, "token")) as f:
        token = f.read().strip()
    req = urllib.request.Request(url + f"/jobs/{ids['b']}/cancel", method="POST",
                                 headers={"Authorization": f"Bearer {token}"})
    assert json.load(urllib.request.urlopen(req, timeout=10)) == {"job": ids["b"], "result": "requested"}
    with pytest.raises(ValueError, match="loopback only"):
        bind("0.0.0.0", 0)
