"""``virtualflow cluster start|status|stop|dashboard``, ``virtualflow submit``, ``virtualflow queue``
and ``virtualflow cancel``: the cluster service on the command line (``docs/cluster_service.md``).

``cluster start`` runs the service in the background by default (a detached process logging to
``DIR/service.log``; the command returns once it is up) and in this process with
``--foreground``. Every other verb works on the cluster directory's database, with or without a
running service: a job submitted while the service is down waits in the queue.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from virtualflow.service.state import ClusterDB, JobRow

DEFAULT_DIR_HELP = "the cluster directory (its database, job run directories, service log, dashboard token)"
MAX_STEPS = 10**12
"""``--steps`` above this is refused (a trillion optimizer steps; it also keeps every step count
inside SQLite's 64-bit integers)."""
PRIORITY_RANGE = (1e-3, 1e3)
"""``--priority`` is a fair-share weight: a job's share is proportional to it, so weights further
apart than a million to one stop meaning anything but "never" (and strain the policies' solvers)."""
PROBE_TIMEOUT_S = 300.0
"""How long ``submit`` waits for the job file to be imported and its function to return."""
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""Control characters, line separators and bidirectional overrides: what rewrites a terminal."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("cluster", help="run the cluster service: a scheduler that places, resizes and preempts jobs",
                       description="The cluster service: jobs submitted with `virtualflow submit` run on emulated "
                                   "accelerator slots, placed each round by a scheduling policy.")
    csub = c.add_subparsers(dest="cluster_command", required=True)
    s = csub.add_parser("start", help="start the service (in the background unless --foreground)")
    s.add_argument("--dir", required=True, help=DEFAULT_DIR_HELP)
    s.add_argument("--slots", required=True, metavar="TYPE=N,...",
                   help="accelerator slots by type, e.g. v100=2,k80=2 (a job runs whole on one type)")
    s.add_argument("--policy", default="las", help="scheduling policy, as in virtualflow simulate (default las)")
    s.add_argument("--round-s", type=float, default=30.0, metavar="SECONDS", help="round length (default 30)")
    s.add_argument("--slowdowns", default=None, metavar="TYPE=F,...",
                   help="emulated speed of a type: its workers run F times slower (default: from Gavel's "
                        "throughput table, fastest type 1)")
    s.add_argument("--mechanism", choices=("default", "lease_first", "gavel"), default="default",
                   help="the round mechanics: 'default' (virtualflow simulate's), 'lease_first' (one global queue, "
                        "lease holders first: the mechanics before issue 17), 'gavel' (Gavel's, spread placement); "
                        "recorded in the cluster's database")
    s.add_argument("--min-run-s", type=float, default=0.0, metavar="SECONDS",
                   help="a (re)started job keeps its placement until it has made a step and run this long (0)")
    s.add_argument("--threads-per-worker", type=int, default=1, metavar="T", help="torch threads per worker (1)")
    s.add_argument("--launch-timeout-s", type=float, default=60.0, metavar="SECONDS",
                   help="how long a job's driver process may take to import, build and check the job before the "
                        "job fails (60)")
    s.add_argument("--hang-factor", type=float, default=10.0, metavar="K",
                   help="a running job is hung (killed, failed) after K of its own step times without a step (10)")
    s.add_argument("--hang-floor-s", type=float, default=120.0, metavar="SECONDS",
                   help="... but never before this many seconds without a step (120)")
    s.add_argument("--hang-first-step-s", type=float, default=600.0, metavar="SECONDS",
                   help="a job that has made no step since its launch is hung after this long (600)")
    s.add_argument("--dashboard-port", type=int, default=None, metavar="PORT",
                   help="also serve the dashboard from the service on 127.0.0.1:PORT (0: any free port; "
                        "default: off, see `cluster dashboard`)")
    s.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: emulated slots, worker processes on this machine (default); ray: a slot of type T "
                        "is one unit of the Ray custom resource T, workers are Ray actors")
    s.add_argument("--address", default=None, metavar="auto|HOST:PORT",
                   help="--backend ray: the Ray cluster (default: RAY_ADDRESS); its nodes must have the slot types "
                        "as resources, e.g. ray start --head --resources '{\"v100\": 2, \"k80\": 2}'")
    s.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="C",
                   help="--backend ray: Ray CPUs each worker actor reserves (1; fractions allowed)")
    s.add_argument("--emulate-slowdowns", action="store_true",
                   help="--backend ray: slow the workers of each type down as on the local backend (default off: "
                        "the types are real hardware; the slowdowns still inform the estimates)")
    s.add_argument("--foreground", action="store_true", help="run in this process (Ctrl-C stops it)")
    s.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for a background service to come up (60)")
    s.set_defaults(func=start)
    st = csub.add_parser("status", help="is the service up; slots and what runs on them")
    st.add_argument("--dir", required=True, help=DEFAULT_DIR_HELP)
    st.set_defaults(func=status)
    sp = csub.add_parser("stop", help="stop the service; running jobs stop with their state kept and stay queued")
    sp.add_argument("--dir", required=True, help=DEFAULT_DIR_HELP)
    sp.add_argument("--timeout", type=float, default=180.0, metavar="SECONDS", help="how long to wait (180)")
    sp.set_defaults(func=stop)
    d = csub.add_parser("dashboard", help="serve the web dashboard on loopback (read-only without the token)")
    d.add_argument("--dir", required=True, help=DEFAULT_DIR_HELP)
    d.add_argument("--port", type=int, default=8266, help="port on 127.0.0.1 (0: any free port; default 8266, beside Ray's 8265)")
    d.set_defaults(func=dashboard)
    from virtualflow.cli import cluster_replay

    cluster_replay.add_parser(csub)  # cluster replay

    sb = sub.add_parser("submit", help="queue a job on a cluster service",
                        description="Queue JOB (a file.py[:function] or module:function returning a virtualflow.Job) "
                                    "on the cluster in --dir. It is checked now: nothing is queued on error.")
    sb.add_argument("job", metavar="JOB.py[:FUNCTION]")
    sb.add_argument("--dir", required=True, help=DEFAULT_DIR_HELP)
    sb.add_argument("--steps", type=int, required=True, help="optimizer steps to run")
    sb.add_argument("--workers", type=int, default=None, metavar="N", help="a rigid job's worker count (default 1)")
    sb.add_argument("--elastic", action="store_true", help="resizable in place between --min-workers and "
                                                             "--max-workers")
    sb.add_argument("--min-workers", type=int, default=None, metavar="A", help="elastic: fewest workers (default 1)")
    sb.add_argument("--max-workers", type=int, default=None, metavar="B", help="elastic: most workers (needed)")
    sb.add_argument("--priority", type=float, default=1.0, metavar="W", help="weight in fair-share policies (1)")
    sb.add_argument("--job-type", default=None, metavar="NAME",
                    help="a job type of Gavel's throughput table (e.g. 'ResNet-18 (batch size 64)'): the emulated "
                         "types slow this job down as they slow that model down")
    sb.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                    help="checkpoint every N steps, what a crash of the service falls back to (default steps/10)")
    sb.add_argument("--deterministic", action="store_true", help="bit-identical weights whatever the placements")
    sb.add_argument("--deadline", default=None, metavar="D",
                    help="when the job should be done: a duration after submission (30m, 2h, 1h30m, 5400 seconds) "
                         "or an ISO time (2026-11-25T18:00, local time without a zone); a job that would miss it "
                         "if it waited another round gets priority (earliest deadline first)")
    sb.add_argument("--batch-size-range", default=None, metavar="B_MIN:B_MAX",
                    help="let the scheduler change the job's global batch to any multiple of its samples per "
                         "virtual node in this range (the elastic_batch policy; changed in place at a step boundary); "
                         "only for a job that reaches its accuracy at every batch of the range")
    sb.add_argument("--lr-rule", default=None, metavar="RULE",
                    help="with --batch-size-range: the learning rate at batch B relative to the job's own batch: "
                         "linear, sqrt or a JSON {\"batch\": multiplier} object")
    sb.add_argument("--vn-size", type=int, default=None, metavar="N",
                    help="with --batch-size-range: samples per virtual node (checked: the job's own)")
    sb.set_defaults(func=submit)

    q = sub.add_parser("queue", help="the jobs of a cluster: state, placement, progress, JCT")
    q.add_argument("--dir", required=True, help=DEFAULT_DIR_HELP)
    q.set_defaults(func=queue)

    cn = sub.add_parser("cancel", help="cancel a queued or running job")
    cn.add_argument("job_id", type=int, metavar="ID")
    cn.add_argument("--dir", required=True, help=DEFAULT_DIR_HELP)
    cn.set_defaults(func=cancel)


# -- cluster start / status / stop / dashboard ---------------------------------------------------
class _StartLock:
    """``DIR/start.lock``, held (``flock``) by one ``cluster start`` from before it writes the
    configuration until its service holds the service lock (a foreground service: for its life).
    Two starts at the same moment would otherwise both write their configuration and the one
    refused later would report the other's settings as its own."""

    def __init__(self, cluster_dir: str) -> None:
        import fcntl

        self.path = os.path.join(cluster_dir, "start.lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise ValueError(f"another cluster start is under way in {cluster_dir} (pid {holder} holds {self.path}), "
                             f"or its service runs in the foreground; wait for it, or stop it (virtualflow cluster "
                             f"stop --dir {cluster_dir})") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        os.close(self.fd)


def start(args: argparse.Namespace) -> int:
    from virtualflow.cluster.model import Cluster
    from virtualflow.service.core import parse_slowdowns
    from virtualflow.service.runner import Service, ServiceLock, init_cluster
    from virtualflow.service.state import check_cluster_dir

    slots = dict(Cluster.parse(args.slots).gpus)
    slowdowns = parse_slowdowns(args.slowdowns) if args.slowdowns else {}
    if args.threads_per_worker < 1:
        raise ValueError(f"--threads-per-worker {args.threads_per_worker} must be >= 1")
    address = args.address
    if args.backend == "ray" and address is None:
        address = os.environ.get("RAY_ADDRESS") or None
    if args.backend == "local" and args.cpus_per_worker != 1.0:
        raise ValueError("--cpus-per-worker applies to --backend ray; add --backend ray or drop it")
    created = not os.path.lexists(args.dir)
    check_cluster_dir(args.dir, create=True)  # a private directory (made 0700 here if missing)
    lock = _StartLock(args.dir)
    try:
        if ServiceLock.held(args.dir):
            raise ValueError(f"a cluster service already runs in {args.dir}; stop it first (virtualflow cluster "
                             f"stop --dir {args.dir})")
        try:
            db = init_cluster(args.dir, slots=slots, policy=args.policy, round_s=args.round_s, slowdowns=slowdowns,
                              threads_per_worker=args.threads_per_worker, min_run_s=args.min_run_s,
                              dashboard_port=args.dashboard_port, backend=args.backend, address=address,
                              cpus_per_worker=args.cpus_per_worker, emulate_slowdowns=args.emulate_slowdowns,
                              mechanism=args.mechanism, launch_timeout_s=args.launch_timeout_s,
                              hang_factor=args.hang_factor, hang_floor_s=args.hang_floor_s,
                              hang_first_step_s=args.hang_first_step_s)
        except BaseException:
            if created:  # nothing of this start stays behind
                try:
                    os.unlink(lock.path)
                    os.rmdir(args.dir)
                except OSError:
                    pass
            raise
        if db.recreated_over is not None:
            print(f"note: {db.path} is new, but this directory handed out job ids up to {db.recreated_over} before; "
                  f"the earlier jobs are not in it (their run directories stay in {os.path.join(args.dir, 'jobs')}), "
                  f"and new job ids continue above {db.recreated_over}")
        db.close()
        if args.foreground:
            import signal

            service = Service(args.dir)
            signal.signal(signal.SIGTERM, service.request_stop)
            try:
                service.run()
            except KeyboardInterrupt:
                pass
            return 0
        log_path = os.path.join(args.dir, "service.log")
        with open(os.devnull, "rb") as devnull, open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "virtualflow.service", os.path.abspath(args.dir)],
                                    stdin=devnull, stdout=log, stderr=log, start_new_session=True, close_fds=True)
        db = ClusterDB(args.dir)
        deadline = time.monotonic() + args.timeout
        while True:
            svc = db.get_meta("service") or {}
            if svc.get("pid") == proc.pid and svc.get("state") == "running":
                break
            if proc.poll() is not None:
                raise RuntimeError(f"the cluster service exited at start-up (code {proc.returncode}); see {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster service (pid {proc.pid}) is not up after {args.timeout} s; see "
                                   f"{log_path}")
            time.sleep(0.1)
        # What the service runs, as recorded (not this command's arguments: they are the same
        # under the start lock, and the record is what the service read).
        cfg = db.config()
        dash = db.get_meta("dashboard")
    finally:
        lock.release()
    shown = ",".join(f"{t}={n}" for t, n in cfg["slots"].items())
    on = f"; Ray cluster {cfg.get('address')}" if cfg.get("backend") == "ray" else ""
    print(f"cluster service running in {args.dir} (pid {proc.pid}; slots {shown}{on}; policy {cfg['policy']}; "
          f"rounds of {float(cfg['round_s']):g} s); log: {log_path}" + (f"; dashboard: {dash}" if dash else ""))
    return 0


def status(args: argparse.Namespace) -> int:
    from virtualflow.service.runner import ServiceLock

    db = ClusterDB(args.dir)
    cfg = db.config()
    svc = db.get_meta("service") or {}
    up = ServiceLock.held(args.dir)
    age = time.time() - float(svc.get("heartbeat_s") or 0)
    print(f"cluster {args.dir}: service {'up' if up else 'down'}"
          + (f" (pid {svc.get('pid')}, heartbeat {age:.1f} s ago)" if up else "")
          + f"; policy {cfg['policy']}; rounds of {cfg['round_s']:g} s"
          + (f"; Ray cluster {cfg.get('address')}" if cfg.get("backend") == "ray" else "")
          + (f"; dashboard {db.get_meta('dashboard')}" if up and db.get_meta("dashboard") else ""))
    jobs = db.jobs()
    holders = {s: j.id for j in jobs if j.state == "running" for s in j.slots}
    from virtualflow.service.core import slot_names

    print("slots: " + ", ".join(f"{s}={'job ' + str(holders[s]) if s in holders else 'free'}"
                                for s in slot_names(cfg["slots"])))
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j.state] = counts.get(j.state, 0) + 1
    print("jobs: " + (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"))
    return 0


def stop(args: argparse.Namespace) -> int:
    from virtualflow.service.runner import ServiceLock

    db = ClusterDB(args.dir)
    if not ServiceLock.held(args.dir):
        print(f"no cluster service runs in {args.dir}")
        return 0
    db.set_meta("stop_requested", True)
    deadline = time.monotonic() + args.timeout
    while ServiceLock.held(args.dir):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster service in {args.dir} has not stopped after {args.timeout} s")
        time.sleep(0.2)
    print(f"cluster service in {args.dir} stopped; running jobs were stopped with their state and stay queued")
    return 0


def dashboard(args: argparse.Namespace) -> int:
    from virtualflow.service.dashboard import serve

    ClusterDB(args.dir).config()  # a cluster directory, configured
    serve(args.dir, port=args.port, announce=lambda url: print(f"dashboard: {url} (read-only; actions need the "
                                                                f"token in {os.path.join(args.dir, 'token')})",
                                                                flush=True))
    return 0


# -- submit / queue / cancel --------------------------------------------------------------------
def printable(text: str) -> str:
    """``text`` with every control character, line separator and bidirectional override shown
    as a visible escape (``\\x1b``, ``\\n``, ``\\u202e``): a name or an error printed to a
    terminal can neither clear the screen nor start a forged row."""
    def escape(m: re.Match[str]) -> str:
        c = m.group()
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
            f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")

    return _UNPRINTABLE.sub(escape, text)


def check_name(name: str) -> str:
    """The job's name, refused (``ValueError``) when it holds control characters."""
    if _UNPRINTABLE.search(name):
        raise ValueError(f"the job's name '{printable(name)}' has control characters (shown escaped); set "
                         f"Job.name to printable text")
    return name


def probe_job(job: str, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Import ``job`` (``file.py[:function]`` or ``module:function``) and call its function in a
    child process; returns ``{"name", "virtual_nodes", "target"}`` (``target``: the absolute spec
    the service will import). Raises ``ValueError`` naming what went wrong.

    Why a child: a job file runs arbitrary code at import, and one that calls ``os._exit(0)`` or
    ``sys.exit(3)`` would end ``submit`` itself with the status it chose (``os._exit(0)`` looked
    like success with nothing queued). The child is forked where the platform can (this process
    has virtualflow and torch imported already: a fresh interpreter would add seconds to every
    submit), else spawned; it has this process's working directory and import path, and what it
    prints goes to a file that is shown only if it dies."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with tempfile.TemporaryDirectory(prefix="virtualflow-submit-") as tmp:
        result, output = os.path.join(tmp, "result.json"), os.path.join(tmp, "output")
        proc = ctx.Process(target=_probe_child, args=(job, result, output), name="virtualflow-submit-check")
        proc.start()
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise ValueError(f"importing the job {job!r} and calling its function took over {timeout_s:g} s; a job "
                             f"function should only describe the job (build models and data in its factories)")
        try:
            with open(result) as f:
                found = json.load(f)
        except (OSError, ValueError):
            try:
                with open(output, "rb") as f:
                    tail = f.read()[-400:].decode("utf-8", "replace").strip()
            except OSError:
                tail = ""
            code = proc.exitcode if proc.exitcode is not None else 0
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            raise ValueError(f"the job {job!r} ended the process that imported it: it {how} while the file was "
                             f"imported or its function called (os._exit? a crash?); nothing was queued"
                             + (f"; its last output: {printable(' '.join(tail.split()))}" if tail else "")) from None
    if "error" in found:  # the user's own message may carry terminal escapes too
        raise ValueError(printable(str(found["error"])))
    return found


def _probe_child(job: str, result: str, output: str) -> None:
    """The child of :func:`probe_job`: build the job, write what was found (or why not) to
    ``result``, and leave without running anyone's exit handlers."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        from virtualflow.config.job import source_from
        from virtualflow.launching.preflight import build_job

        built = build_job(job, job)  # imports the file and calls the function
        found: dict[str, Any] = {"name": str(built.name), "virtual_nodes": int(built.virtual_nodes),
                                 "global_batch_size": int(built.global_batch_size), "target": source_from(job).target}
    except SystemExit as exc:
        found = {"error": f"the job {job!r} called sys.exit({exc.code!r}) while the file was imported or its function "
                          f"called; nothing was queued (a job file defines its job function, it does not exit)"}
    except (ValueError, TypeError) as exc:
        found = {"error": " ".join(str(exc).split()) or type(exc).__name__}
    except BaseException as exc:  # noqa: BLE001 - the user's code; reported, not raised
        found = {"error": f"importing the job {job!r} or calling its function failed: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:400]}"}
    with open(result + ".tmp", "w") as f:
        json.dump(found, f)
    os.replace(result + ".tmp", result)
    os._exit(0)  # the job's atexit handlers (and this process's inherited ones) are not ours to run


def check_submission(cluster_dir: str, job: str, *, steps: int, workers: int | None, elastic: bool,
                     min_workers: int | None, max_workers: int | None, priority: float, job_type: str | None,
                     checkpoint_every: int | None, deadline: str | None = None,
                     now: float | None = None, batch_size_range: str | None = None, lr_rule: str | None = None,
                     vn_size: int | None = None) -> dict[str, Any]:
    """Every check of a submission, before anything is written; returns the row's fields
    (``now``: the submission time, what a ``deadline`` duration counts from), ``target`` among
    them. The job is imported and built in a child process (:func:`probe_job`)."""
    import math

    db = ClusterDB(cluster_dir)
    cfg = db.config()
    biggest = max(int(n) for n in cfg["slots"].values())
    path = job.partition(":")[0]
    if (path.endswith(".py") or os.sep in path) and not os.path.isfile(path):
        raise ValueError(f"job file {path!r} does not exist; give JOB.py[:FUNCTION] (the default function is "
                         f"make_job)")
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"--steps {steps} must be a number of optimizer steps between 1 and {MAX_STEPS}")
    deadline_s = None
    if deadline is not None:
        from virtualflow.service.deadlines import parse_deadline

        deadline_s = parse_deadline(deadline, time.time() if now is None else now)
    lo_w, hi_w = PRIORITY_RANGE
    if not (math.isfinite(priority) and lo_w <= priority <= hi_w):
        raise ValueError(f"--priority {priority:g} must be a weight between {lo_w:g} and {hi_w:g} (a fair-share "
                         f"policy gives a job a share proportional to it; default 1)")
    if elastic:
        if workers is not None:
            raise ValueError("--workers is a rigid job's count; an --elastic job takes --min-workers and --max-workers")
        if max_workers is None:
            raise ValueError("an --elastic job needs --max-workers B (and optionally --min-workers A, default 1)")
        lo, hi = (1 if min_workers is None else min_workers), max_workers
        if lo < 1:
            raise ValueError(f"--min-workers {lo} must be >= 1")
        if lo > hi:
            raise ValueError(f"--min-workers {lo} is greater than --max-workers {hi}; lower --min-workers or raise "
                             f"--max-workers")
        if lo > biggest:
            raise ValueError(f"--min-workers {lo} is more than the largest slot type has ({biggest}: "
                             f"{cfg['slots']}); a job runs whole on one type: lower --min-workers")
        if hi > biggest:
            raise ValueError(f"--max-workers {hi} is more than the largest slot type has ({biggest}: "
                             f"{cfg['slots']}); a job runs whole on one type: lower --max-workers to {biggest}")
    else:
        if min_workers is not None or max_workers is not None:
            raise ValueError("--min-workers/--max-workers apply to --elastic jobs; a rigid job takes --workers N")
        lo = hi = 1 if workers is None else workers
        if lo < 1:
            raise ValueError(f"--workers {lo} must be >= 1")
        if lo > biggest:
            raise ValueError(f"--workers {lo} is more than the largest slot type has ({biggest}: {cfg['slots']}); "
                             f"a job runs whole on one type: lower --workers")
    if job_type is not None:
        from virtualflow.service.runner import gavel_table

        table = gavel_table()
        if not table.has(job_type, 1):
            raise ValueError(f"--job-type {job_type!r} is not in Gavel's throughput table; choose one of "
                             f"{list(table.job_types)[:6]}... or leave it out")
    if checkpoint_every is None:
        checkpoint_every = max(1, steps // 10)
    elif not 1 <= checkpoint_every <= steps:
        raise ValueError(f"--checkpoint-every {checkpoint_every} must be between 1 and --steps {steps} (a longer "
                         f"interval never checkpoints before the job ends)")
    from virtualflow.service.batch import batch_cell, parse_range, parse_rule

    rng = parse_range(batch_size_range) if batch_size_range is not None else None
    rule = parse_rule(lr_rule) if lr_rule is not None else None
    if rng is None and (rule is not None or vn_size is not None):
        batch_cell(None, rule, vn_size, global_batch_size=1, virtual_nodes=1, min_workers=lo, max_workers=hi,
                   elastic=elastic)  # refused before the job is built
    built = probe_job(job)  # its errors (and an exit from the job's own code) are reported now
    V = built["virtual_nodes"]
    batch = batch_cell(rng, rule, vn_size, global_batch_size=built.get("global_batch_size", V), virtual_nodes=V,
                       min_workers=lo, max_workers=hi, elastic=elastic)
    if batch is not None:  # an elastic batch: up to a VN per worker at its largest batch (grown in place)
        V = batch["range"][1] // batch["vn_size"]
    if hi > V:
        raise ValueError(f"{'--max-workers' if elastic else '--workers'} {hi} is more than the job's virtual_nodes={V}"
                         f": every worker needs at least one virtual node")
    from virtualflow.service.dashboard import DEFAULT_JOB_NAME, default_name

    name = check_name(built["name"])
    if not name or name == DEFAULT_JOB_NAME:  # Job.name left as it is: the file (and function) tell jobs apart
        name = default_name(built["target"])
    return dict(name=name, target=built["target"], steps=steps, elastic=elastic, min_workers=lo, max_workers=hi,
                priority=priority, job_type=job_type, checkpoint_every=checkpoint_every, deadline_s=deadline_s,
                batch=batch)


def submit(args: argparse.Namespace) -> int:
    now = time.time()
    fields = check_submission(args.dir, args.job, steps=args.steps, workers=args.workers, elastic=args.elastic,
                              min_workers=args.min_workers, max_workers=args.max_workers, priority=args.priority,
                              job_type=args.job_type, checkpoint_every=args.checkpoint_every, deadline=args.deadline,
                              now=now, batch_size_range=args.batch_size_range, lr_rule=args.lr_rule,
                              vn_size=args.vn_size)
    db = ClusterDB(args.dir)
    job_id = db.add_job(deterministic=args.deterministic, now=now, **fields)
    shape = (f"elastic {fields['min_workers']}-{fields['max_workers']} workers" if args.elastic
             else f"{fields['max_workers']} worker{'s' if fields['max_workers'] > 1 else ''}")
    due = ""
    if fields["deadline_s"] is not None:
        from virtualflow.service.deadlines import format_duration

        due = (f", deadline {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(fields['deadline_s']))} "
               f"(in {format_duration(fields['deadline_s'] - now)})")
    print(f"job {job_id} queued: {printable(fields['name'])}, {args.steps} steps, {shape}, priority "
          f"{args.priority:g}{due}")
    return 0


def format_queue(jobs: list[JobRow], now: float) -> str:
    head = f"{'id':>4} {'name':<16} {'state':<11} {'placement':<14} {'progress':>13} {'JCT s':>8} {'restarts':>8} " \
           f"{'resizes':>7}"
    due = any(j.deadline_s is not None for j in jobs)
    if due:
        head += f" {'deadline':>12} {'slack':>8}"
    lines = [head]
    for j in jobs:
        place = f"{j.workers}x{j.acc_type}" if j.state == "running" and j.acc_type else "-"
        shape = f" ({j.min_workers}-{j.max_workers})" if j.elastic else ""
        end = j.finished_s if j.finished_s is not None else now
        prog = f"{j.steps_done}/{j.steps}"
        line = (f"{j.id:>4} {printable(j.name)[:16]:<16} {j.state:<11} {place + shape:<14} {prog:>13} "
                f"{end - j.submitted_s:>8.1f} {j.restarts:>8} {j.resizes:>7}")
        if due:
            from virtualflow.service.deadlines import deadline_cells

            deadline, slack = deadline_cells(j, now)
            line += f" {deadline:>12} {slack:>8}"
        lines.append(line)
        if j.state == "failed" and j.error:
            lines.append(f"     error: {printable(j.error)[:200]}")
        if j.quarantine:  # never scheduled until the row is fixed or cancelled: say why
            lines.append(f"     quarantined: {printable(j.quarantine)[:200]}")
    return "\n".join(lines)


def queue(args: argparse.Namespace) -> int:
    db = ClusterDB(args.dir)
    print(format_queue(db.jobs(), time.time()))
    return 0


def cancel(args: argparse.Namespace) -> int:
    from virtualflow.service.dashboard import MAX_ROW_ID

    db = ClusterDB(args.dir)
    if not 1 <= args.job_id <= MAX_ROW_ID:  # no such row can exist (SQLite would overflow on a larger one)
        raise ValueError(f"job {args.job_id} does not exist in {args.dir}; see virtualflow queue --dir {args.dir}")
    what = db.request_cancel(args.job_id)
    if what == "cancelled":
        print(f"job {args.job_id} cancelled (it was queued)")
    elif what == "requested":
        print(f"job {args.job_id} will be stopped and cancelled by the service at its next check")
    else:
        print(f"job {args.job_id} had already ended ({what}); nothing to cancel")
    return 0
