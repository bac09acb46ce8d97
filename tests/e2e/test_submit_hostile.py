"""Inputs that hung or misled ``submit``, ``queue``, ``plan`` and ``cluster replay --export``
(issues 26 and 27): each is refused or reported with one line and a non-zero exit, nothing is
queued, and what is printed cannot rewrite the terminal.
"""

from __future__ import annotations

import json
import os
import shlex
import textwrap

import pytest

from virtualflow.cli import main as cli_main
from virtualflow.cli.cluster import format_queue, printable
from virtualflow.service.runner import init_cluster
from virtualflow.service.state import ClusterDB

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(HERE, "service_jobs.py")


@pytest.fixture
def cluster(tmp_path):
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 2, "k80": 1}, policy="las", round_s=5.0).close()
    return d


def job_file(tmp_path, body: str) -> str:
    path = tmp_path / "job_file.py"
    path.write_text(f"import sys\nsys.path.insert(0, {HERE!r})\nimport jobs\n" + textwrap.dedent(body))
    return str(path)


def submit(d: str, capsys, *args: str) -> tuple[int, str, str]:
    rc = cli_main.main(["submit", *args, "--dir", d])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("args,message", [
    (["--steps", "10", "--checkpoint-every", "10000000000000000000000"],
     "--checkpoint-every 10000000000000000000000 must be between 1 and --steps 10"),
    (["--steps", "10000000000000000000000"], "--steps 10000000000000000000000 must be a number of optimizer steps "
                                             "between 1 and 1000000000000"),
    (["--steps", "10", "--priority", "1e-15"], "--priority 1e-15 must be a weight between 0.001 and 1000"),
    (["--steps", "10", "--priority", "inf"], "--priority inf must be a weight between 0.001 and 1000"),
    (["--steps", "10", "--elastic", "--max-workers", "4"],
     "--max-workers 4 is more than the largest slot type has (2: {'v100': 2, 'k80': 1})"),
])
def test_out_of_range_numbers_are_refused(cluster, capsys, args, message):
    rc, out, err = submit(cluster, capsys, f"{JOBS}:paced", *args)
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert ClusterDB(cluster).jobs() == []


def test_more_workers_than_virtual_nodes_is_refused(cluster, capsys, tmp_path):
    path = job_file(tmp_path, """
        def make_job():
            return jobs.paced_regression_job().replace(virtual_nodes=1, global_batch_size=8)
    """)
    rc, out, err = submit(cluster, capsys, path, "--steps", "10", "--workers", "2")
    assert rc == 2 and "--workers 2 is more than the job's virtual_nodes=1" in err, err
    assert ClusterDB(cluster).jobs() == []


@pytest.mark.parametrize("body,message", [
    ("import os\nos._exit(0)\n", "ended the process that imported it: it exited with status 0"),
    ("sys.exit(3)\n", "called sys.exit(3) while the file was imported"),
    ("def make_job():\n    sys.exit('no')\n", "called sys.exit('no')"),
    ("def make_job():\n    raise RuntimeError('bad \\x1b[2J thing')\n", "raised RuntimeError: bad \\x1b[2J thing"),
])
def test_a_job_file_that_exits_or_fails_is_reported_and_nothing_is_queued(cluster, capsys, tmp_path, body, message):
    rc, out, err = submit(cluster, capsys, job_file(tmp_path, body), "--steps", "10")
    assert rc == 2 and message in err and "\x1b" not in err and err.count("\n") == 1, err
    assert out == "" and ClusterDB(cluster).jobs() == []


def test_names_with_control_characters_are_refused_and_escaped_when_printed(cluster, capsys, tmp_path):
    forged = "evil\x1b[2J\x1b[H\n 9 forged done\u202e"
    path = job_file(tmp_path, f"""
        def make_job():
            return jobs.paced_regression_job().replace(name={forged!r})

        def default():
            return jobs.paced_regression_job().replace(name="job")
    """)
    rc, out, err = submit(cluster, capsys, path, "--steps", "10")
    assert rc == 2 and "\\x1b[2J\\x1b[H\\n 9 forged done\\u202e" in err and "\x1b" not in err
    assert err.count("\n") == 1 and ClusterDB(cluster).jobs() == []
    # A job that keeps Job.name's default is named by its file and function.
    rc, out, err = submit(cluster, capsys, f"{path}:default", "--steps", "10")
    assert rc == 0 and out == "job 1 queued: job_file:default, 10 steps, 1 worker, priority 1\n", err
    # A row written before names were checked (or by another tool) is escaped by `queue`.
    db = ClusterDB(cluster)
    db.add_job(name=forged, target="x.py:f", steps=5, elastic=False, min_workers=1, max_workers=1, priority=1.0,
               job_type=None, deterministic=True, checkpoint_every=1)
    assert cli_main.main(["queue", "--dir", cluster]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and len(out.splitlines()) == 3  # header + 2 jobs
    assert printable(forged)[:16] in out
    (row,) = [r for r in db.jobs() if r.name == forged]
    db.set_job_state(row.id, "failed", event="failed", error="boom\n   7 forged\x1b[31m")
    text = format_queue(db.jobs(), 0.0)
    assert "\x1b" not in text and len(text.splitlines()) == 4 and "error: boom\\n   7 forged\\x1b[31m" in text


def test_plan_reports_a_model_that_calls_sys_exit(capsys, tmp_path):
    path = job_file(tmp_path, """
        def model_exits():
            sys.exit(3)

        def make_job():
            return jobs.pipelined_job().replace(model=model_exits)
    """)
    rc = cli_main.main(["plan", path, "--stages", "2", "--repeats", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "called sys.exit(3) while plan imported, built or profiled it" in err, err


def test_an_export_with_an_elastic_job_wider_than_the_cluster_simulates(tmp_path, capsys):
    """A database from before submit refused --max-workers above the largest type (job 2 asks for
    4 on a cluster of 2): the trace asks for 2, and the command the export prints runs."""
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 2}, policy="fifo", round_s=2.0, slowdowns={}).close()
    db = ClusterDB(d)
    t0 = 5000.0
    ids = [db.add_job(name=f"j{i}", target="x.py:f", steps=20, elastic=i == 2, min_workers=1,
                      max_workers=4 if i == 2 else 1, priority=1.0, job_type=None, deterministic=True,
                      checkpoint_every=10) for i in (1, 2)]
    for k, jid in enumerate(ids):
        run_dir = tmp_path / f"run{jid}"
        os.makedirs(run_dir)
        db.update_job(jid, submitted_s=t0 + k, run_dir=str(run_dir))
    r = db.add_round(start_s=t0 + 0.1, policy="fifo", solved=True, decision_s=0.001, active=2, placements=[])
    for k, jid in enumerate(ids):  # each ran on one worker
        workers = 1
        db.event("start", jid, now=t0 + 0.3 + k, acc_type="v100", workers=workers, resumed=False)
        with open(tmp_path / f"run{jid}" / "metrics.jsonl", "w") as f:
            for s in range(20):
                f.write(json.dumps({"time": t0 + 1.0 + k + 0.05 * s, "step": s, "loss": 1.0, "workers": workers})
                        + "\n")
        done = t0 + 2.1 + k
        db.set_job_state(jid, "done", now=done, event="done", finished_s=done, steps_done=20)
    db.end_round(r, t0 + 4.0)
    db.close()
    out = str(tmp_path / "export")
    assert cli_main.main(["cluster", "replay", "--dir", d, "--export", out]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    command = printed.split("simulate it with:\n", 1)[1].splitlines()[0].strip()
    with open(os.path.join(out, "trace.json")) as f:
        trace = json.load(f)
    text = json.dumps(trace)
    assert '"scale_factor": 4' not in text and '"scale_factor": 2' in text, text
    argv = shlex.split(command)
    assert argv[:2] == ["virtualflow", "simulate"]
    rc = cli_main.main(argv[1:])
    captured = capsys.readouterr()
    assert rc == 0, captured.err


def test_cancel_of_an_id_no_row_can_have_is_refused(cluster, capsys):
    for text in ("99999999999999999999", "0"):
        assert cli_main.main(["cancel", text, "--dir", cluster]) == 2
        err = capsys.readouterr().err
        assert f"job {text} does not exist" in err and err.count("\n") == 1, err
