"""Job code never runs in the cluster service's process: each job runs under a child process.

The service starts one **job driver** per launch: ``python -m virtualflow.service.launcher
CMD_FD MSG_FD``, a fresh interpreter (never forked from the service) in a session of its own.
The driver imports the job's target, builds and preflights it and starts its workers with
:func:`virtualflow.launch` (so the job's coordinator lives there too), then relays between the
job's handle and the service over two pipes of JSON lines:

- service -> driver (``CMD_FD``): the launch request first (target and launch options), then
  ``resize``, ``batch`` (:meth:`virtualflow.JobHandle.change_batch`), ``slowdown``, ``stop`` and
  ``kill`` commands;
- driver -> service (``MSG_FD``): ``building`` (the job's code runs from now on), ``started``, ``status`` (step, state, members, loss, the
  coordinator's recent step times: about
  five times a second while something changes, once a second otherwise), and one final
  ``result`` (steps, stopped, loss) or ``error`` (one line).

What the service learns is plain data: it parses each line defensively (bounded length, known
kinds, checked types) and drops what does not fit; nothing is unpickled. The job's own output
(its prints, its logging, tracebacks) goes to the driver's log file, never into the message pipe.

Whatever the job's code does while it is built and checked - raise, ``sys.exit``,
``os._exit``, crash the interpreter (SIGSEGV), sleep for ever - happens in the driver: the
service sees an ``error`` message, an exit without a result, or no ``started`` within
``launch_timeout_s`` (then it kills the driver), and records *that job* failed with the reason;
every other job and the service go on. (The limit counts from ``building``: a driver's own start,
slow on a loaded machine, is bounded apart by :data:`DRIVER_START_S`.) If the service dies, the driver sees its command pipe
close and stops the job at the next step boundary with the state written.

**Identity of a job's processes.** Every driver, and through the environment every local worker
it starts, carries ``VIRTUALFLOW_SERVICE_JOB=<the job's run directory>`` (:data:`MARKER_ENV`).
A restarted service only ever signals a process that carries its job's marker (read from
``/proc/PID/environ``) and that started no later than the job's ``status.json`` was written
(``/proc/PID/stat``): a PID reused by another process fails both checks
(:func:`virtualflow.backends.orphans.is_job_process`, re-exported here).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from virtualflow.backends.orphans import MARKER_ENV, is_job_process, job_processes, start_time_s

log = logging.getLogger(__name__)

__all__ = ["MARKER_ENV", "ChildJob", "ChildResult", "JobProcessError", "describe_exit", "is_job_process",
           "job_processes", "job_with_batch", "start_time_s", "parse_message"]


MAX_LINE = 1 << 20
"""Longest message line read from either side (a longer one is dropped)."""

KINDS = ("building", "started", "status", "result", "error", "note")

DRIVER_START_S = 120.0
"""How long a driver may take to start (its interpreter, torch, virtualflow: no job code yet)
before it says it builds the job; ``launch_timeout_s`` counts from then."""
OPS = ("resize", "batch", "slowdown", "stop", "kill")


class JobProcessError(RuntimeError):
    """The job ended without a result: its driver reported an error or exited without one."""


@dataclass(frozen=True, slots=True)
class ChildResult:
    """What a finished job reported (plain data): steps reached, whether it was stopped early,
    its last loss (as ``history[-1]["loss"]``, like :class:`virtualflow.Result`)."""

    steps: int
    stopped: bool
    history: list[dict[str, Any]] = field(default_factory=list)


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def parse_message(line: bytes) -> dict[str, Any] | None:
    """One driver -> service message, validated and reduced to known fields; None if malformed."""
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(msg, dict) or msg.get("kind") not in KINDS:
        return None
    kind = msg["kind"]
    if kind == "building":
        return {"kind": kind}
    if kind in ("started", "status"):
        st = msg.get("status")
        if not isinstance(st, dict):
            return None
        workers = []
        for w in st.get("workers") if isinstance(st.get("workers"), list) else []:
            if isinstance(w, dict) and _int(w.get("id")) is not None:
                node = w.get("node")
                workers.append({"id": w["id"], "rank": _int(w.get("rank")), "pid": _int(w.get("pid")),
                                "node": node[:200] if isinstance(node, str) else None})
        state = st.get("state")
        times = st.get("step_times") if isinstance(st.get("step_times"), list) else []
        times = [t for t in map(_finite, times[:50]) if t is not None and t >= 0]
        return {"kind": kind, "status": {"state": state[:40] if isinstance(state, str) else "unknown",
                                         "step": _int(st.get("step")), "workers": workers[:4096],
                                         "loss": _finite(st.get("loss")), "step_times": times}}
    if kind == "result":
        steps = _int(msg.get("steps"))
        if steps is None or steps < 0:
            return None
        return {"kind": kind, "steps": steps, "stopped": bool(msg.get("stopped")), "loss": _finite(msg.get("loss"))}
    text = msg.get("error" if kind == "error" else "text")
    if not isinstance(text, str):
        return None
    return {"kind": kind, ("error" if kind == "error" else "text"): " ".join(text.split())[:2000],
            "disk_full": bool(msg.get("disk_full"))}


def describe_exit(code: int | None) -> str:
    """``-11`` -> ``"was killed by signal SIGSEGV"``, ``3`` -> ``"exited with status 3"``."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class ChildJob:
    """The service's handle on one job driver (same calls as :class:`virtualflow.JobHandle`:
    ``status``, ``resize``, ``set_slowdown``, ``stop``, ``kill``, ``wait``, ``done``), never
    blocking except in ``stop``/``wait`` with a timeout. A reader thread keeps the latest status."""

    def __init__(self, target: str, options: dict[str, Any], *, marker: str, log_path: str,
                 launch_timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        self.target, self.marker, self.log_path = target, marker, log_path
        self.options = dict(options)
        batch = self.options.pop("batch", None)  # a resumed elastic-batch job's recorded changes
        self.launch_timeout_s = launch_timeout_s
        self.launched_s = time.monotonic()
        self._status: dict[str, Any] = {"state": "launching", "step": None, "workers": [], "loss": None}
        self._started = threading.Event()
        self._result: ChildResult | None = None
        self._error: str | None = None
        self._disk_full = False
        self._lock = threading.Lock()
        env = dict(os.environ if env is None else env)
        env[MARKER_ENV] = marker
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd_r, cmd_w = os.pipe()
        msg_r, msg_w = os.pipe()
        os.makedirs(os.path.dirname(log_path), mode=0o700, exist_ok=True)
        logf = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "virtualflow.service.launcher", str(cmd_r), str(msg_w)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                pass_fds=(cmd_r, msg_w), start_new_session=True)
        finally:
            logf.close()
            os.close(cmd_r)
            os.close(msg_w)
        self._cmd = os.fdopen(cmd_w, "wb", buffering=0)
        self._msgs = os.fdopen(msg_r, "rb")
        self._send({"op": "launch", "target": target, "options": self.options, "batch": batch})  # an empty pipe: never blocks
        # From now on a command the driver does not read (it is busy building the job) never blocks
        # the service: each is one write of less than PIPE_BUF bytes, all or nothing.
        os.set_blocking(cmd_w, False)
        self._building = False
        self._timer = threading.Timer(max(DRIVER_START_S, launch_timeout_s), self._launch_expired)
        self._timer.daemon = True
        self._reader = threading.Thread(target=self._read, name=f"job-driver-{self.proc.pid}", daemon=True)
        self._reader.start()
        self._timer.start()

    # -- the pipes -------------------------------------------------------------------------
    def _send(self, msg: dict[str, Any]) -> bool:
        """Write one command; False if the driver is gone or its pipe is full (never blocks)."""
        try:
            data = json.dumps(msg).encode() + b"\n"
            with self._lock:
                return self._cmd.write(data) == len(data)  # None: the pipe is full
        except (OSError, ValueError):  # gone (its exit is what counts), or not reading: see callers
            return False

    def _read(self) -> None:
        try:
            while True:
                line = self._msgs.readline(MAX_LINE + 1)
                if not line:
                    break
                if len(line) > MAX_LINE or not line.endswith(b"\n"):
                    log.warning("job driver %d (%s): dropped an overlong message", self.proc.pid, self.target)
                    while line and not line.endswith(b"\n"):  # skip the rest of that line
                        line = self._msgs.readline(MAX_LINE + 1)
                    continue
                msg = parse_message(line)
                if msg is None:
                    log.warning("job driver %d (%s): dropped a malformed message %r", self.proc.pid, self.target,
                                line[:200])
                    continue
                self._take(msg)
        except (OSError, ValueError):
            pass
        finally:
            self._msgs.close()
            self.proc.wait()
            self._timer.cancel()

    def _take(self, msg: dict[str, Any]) -> None:
        kind = msg["kind"]
        if kind == "building" and not self._building:
            # The job's own code runs from now on: its time limit starts (the interpreter's start
            # and torch's import, slow on a loaded machine, are not the job's).
            self._building = True
            self._timer.cancel()
            self._timer = threading.Timer(self.launch_timeout_s, self._launch_expired)
            self._timer.daemon = True
            self._timer.start()
        elif kind in ("started", "status"):
            self._status = msg["status"]
            if kind == "started":
                self._started.set()
        elif kind == "result" and self._result is None and self._error is None:
            self._result = ChildResult(msg["steps"], msg["stopped"], [{"loss": msg["loss"]}])
        elif kind == "error" and self._result is None and self._error is None:
            self._error, self._disk_full = msg["error"], msg["disk_full"]
        elif kind == "note":
            log.warning("job %s: %s", self.marker, msg["text"])

    def _launch_expired(self) -> None:
        if self._started.is_set() or self.proc.poll() is not None:
            return
        if not self._building:
            self._error = (f"the job's driver process did not start within {max(DRIVER_START_S, self.launch_timeout_s):g} "
                           f"s (a fresh interpreter importing torch and virtualflow: is the machine overloaded?); it was "
                           f"killed (log: {self.log_path})")
            self._kill_now()
            return
        self._error = (f"building and checking the job (importing {self.target}, the job function, its dataset, "
                       f"model, optimizer and loss) did not finish within {self.launch_timeout_s:g} s (the cluster's "
                       f"launch_timeout_s); its driver was killed (log: {self.log_path})")
        self._kill_now()

    def _kill_now(self) -> None:
        try:
            self.proc.kill()  # our own child, not yet reaped: its PID cannot have been reused
        except OSError:
            pass

    # -- the handle ------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._started.is_set()

    @property
    def backend(self) -> SimpleNamespace:
        """A read-only view for observers (as :attr:`virtualflow.JobHandle.backend`): what this
        launch asked for (``options.resources``, ``config.slowdowns``) and, as the driver last
        reported, the Ray node of each worker (``workers[id].node_id``; None on the local backend
        or while unplaced)."""
        slowdowns = self.options.get("slowdowns") or []
        return SimpleNamespace(
            name=self.options.get("backend", "local"),
            options=SimpleNamespace(resources=dict(self.options.get("resources") or {})),
            config=SimpleNamespace(slowdowns={i: float(f) for i, f in enumerate(slowdowns) if f != 1.0}),
            workers={w["id"]: SimpleNamespace(node_id=w.get("node")) for w in self._status.get("workers", [])})

    @property
    def disk_full(self) -> bool:
        """The job ended because its files could not be written (out of space)."""
        return self._disk_full

    def status(self) -> dict[str, Any]:
        """The latest status the driver sent (``step`` is None until the job has started)."""
        return dict(self._status)

    def resize(self, workers: int) -> None:
        self._send({"op": "resize", "workers": int(workers)})

    def change_batch(self, virtual_nodes: int, lr_rule: Any) -> None:
        self._send({"op": "batch", "virtual_nodes": int(virtual_nodes), "lr_rule": lr_rule})

    def set_slowdown(self, worker: int, factor: float) -> None:
        self._send({"op": "slowdown", "worker": int(worker), "factor": float(factor)})

    def request_stop(self, reason: str) -> None:
        """Ask for a stop at the next step boundary with the state written; returns at once."""
        if not self._send({"op": "stop", "reason": reason}):
            self._kill_now()

    def stop(self, timeout_s: float = 60.0, *, reason: str = "stop() called") -> ChildResult:
        """Stop at the next step boundary; kill the job if that takes more than ``timeout_s``."""
        self.request_stop(reason)
        try:
            return self.wait(timeout_s)
        except TimeoutError:
            self.kill()
            self._reader.join(10.0)
            raise

    def kill(self, grace_s: float = 3.0) -> None:
        """Kill the job's workers and its driver (the driver first ends its workers itself; after
        ``grace_s`` it is SIGKILLed, and its local workers exit with it). Returns at once."""
        if self.proc.poll() is not None:
            return
        if self._error is None and self._result is None:
            self._error = "killed by the cluster service"
        self._send({"op": "kill"})
        timer = threading.Timer(grace_s, self._kill_now)
        timer.daemon = True
        timer.start()

    @property
    def done(self) -> bool:
        if self._reader.is_alive() and self.proc.poll() is not None:
            # Exited: what it wrote is in the pipe. A process it forked may hold the pipe open
            # (no end of file): give the reader a moment, then take what it has read as all.
            self._reader.join(0.5)
            if self._reader.is_alive():
                self._timer.cancel()
                return True
        return not self._reader.is_alive()

    def wait(self, timeout_s: float | None = None) -> ChildResult:
        """The result, once the driver has exited; raises :class:`JobProcessError` when the job
        ended without one (the message says why), ``TimeoutError`` while it runs."""
        self._reader.join(timeout_s)
        if self._reader.is_alive() and not self.done:
            raise TimeoutError(f"job {self.target} is still running after {timeout_s} s")
        if self._result is not None:
            return self._result
        if self._error is not None:
            raise JobProcessError(self._error)
        phase = "while the job was built and checked" if not self.started else "without reporting a result"
        raise JobProcessError(f"the job's driver process {describe_exit(self.proc.returncode)} {phase} (the job's "
                              f"code called os._exit or crashed the interpreter?); log: {self.log_path}")


# -- the driver (child side) ----------------------------------------------------------------
def _disk_full(exc: BaseException | None, text: str) -> bool:
    import errno

    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
    return "No space left on device" in text or "disk is full" in text or "Disk quota exceeded" in text


def _why(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"the job's code called sys.exit({exc.code!r}) while the job was built and checked"
    if isinstance(exc, KeyboardInterrupt):
        return "the job's code raised KeyboardInterrupt while the job was built and checked"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def job_with_batch(target: str, batch_schedule: list[list[int]], lr_rule: Any) -> Any:
    """The job of ``target`` with the batch changes its run recorded (a resumed elastic-batch job
    of the cluster service: its checkpoint's changes must be the job's, and the run goes on with
    them); what the driver launches in place of ``target`` then (importable: it reaches the workers
    by reference)."""
    from virtualflow.config.job import source_from

    rule = {int(b): float(m) for b, m in lr_rule.items()} if isinstance(lr_rule, dict) else lr_rule
    return source_from(target).load().replace(batch_schedule=[tuple(c) for c in batch_schedule], lr_rule=rule)


def driver_main(cmd_fd: int, msg_fd: int) -> int:
    """The job driver (see the module docstring). Exit status 0 once a result or an error was sent."""
    out = os.fdopen(msg_fd, "wb", buffering=0)
    cmds = os.fdopen(cmd_fd, "rb")

    def send(msg: dict[str, Any]) -> None:
        try:
            out.write(json.dumps(msg, default=str).encode() + b"\n")
        except (OSError, ValueError):
            pass  # the service is gone: the command pipe's end says so too

    first = cmds.readline(MAX_LINE)
    try:
        req = json.loads(first)
        target, options = req["target"], req["options"]
        if not (req.get("op") == "launch" and isinstance(target, str) and isinstance(options, dict)):
            raise ValueError("not a launch request")
    except (ValueError, KeyError, TypeError) as exc:
        send({"kind": "error", "error": f"malformed launch request from the service: {exc}"})
        return 2
    inbox: queue.Queue[dict[str, Any]] = queue.Queue()
    started = threading.Event()

    def read_commands() -> None:
        for line in iter(lambda: cmds.readline(MAX_LINE), b""):
            try:
                cmd = json.loads(line)
            except ValueError:
                continue
            if isinstance(cmd, dict) and cmd.get("op") in OPS:
                inbox.put(cmd)
        if not started.is_set():  # the service died while the job was being built: nothing to keep
            os._exit(3)  # (workers started meanwhile exit with their launcher)
        inbox.put({"op": "gone"})

    threading.Thread(target=read_commands, name="service-commands", daemon=True).start()
    send({"kind": "building"})  # the job's time limit starts now (virtualflow and torch are imported)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import virtualflow

        batch = req.get("batch")
        job: Any = target
        if isinstance(batch, dict) and batch.get("batch_schedule"):
            job = functools.partial(job_with_batch, target, batch["batch_schedule"], batch["lr_rule"])
        handle = virtualflow.launch(job, **options)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: the job's code, the job's failure
        text = _why(exc)
        logging.getLogger("virtualflow").error("the job could not start: %s", text, exc_info=True)
        send({"kind": "error", "error": text, "disk_full": _disk_full(exc, text)})
        return 0

    last_status: dict[str, Any] = {}

    def status() -> dict[str, Any]:
        nonlocal last_status
        try:
            st = handle.status()
        except Exception:  # noqa: BLE001 - between states: the last one stands
            return last_status
        nodes = {wid: getattr(proc, "node_id", None) for wid, proc in getattr(handle.backend, "workers", {}).items()}
        last_status = {"state": st.get("state"), "step": st.get("step"), "loss": st.get("loss"),
                       "step_times": st.get("recent_step_times_s"),
                       "workers": [{"id": w.get("id"), "rank": w.get("rank"), "pid": w.get("pid"),
                                    "node": nodes.get(w.get("id"))}
                                   for w in st.get("workers", []) if isinstance(w, dict)]}
        return last_status

    started.set()
    send({"kind": "started", "status": status()})
    last, sent_s = None, 0.0
    stopping: threading.Thread | None = None

    def stop_in_background(reason: str, timeout_s: float) -> threading.Thread:
        def run() -> None:
            try:
                handle.stop(timeout_s=timeout_s, reason=reason)
            except BaseException:  # noqa: BLE001 - reported through wait() below
                pass

        t = threading.Thread(target=run, name="stop", daemon=True)
        t.start()
        return t

    while not handle.done:
        try:
            cmd = inbox.get(timeout=0.2)
        except queue.Empty:
            cmd = None
        try:
            if cmd is None:
                pass
            elif cmd["op"] == "resize" and _int(cmd.get("workers")) is not None:
                handle.resize(cmd["workers"])
            elif cmd["op"] == "batch" and _int(cmd.get("virtual_nodes")) is not None:
                rule = cmd.get("lr_rule")  # (JSON keys are strings: the job's {batch: multiplier} has ints)
                handle.change_batch(cmd["virtual_nodes"], {int(b): m for b, m in rule.items()} if isinstance(rule, dict)
                                    else rule)
            elif cmd["op"] == "slowdown" and _int(cmd.get("worker")) is not None and _finite(cmd.get("factor")):
                handle.set_slowdown(cmd["worker"], cmd["factor"])
            elif cmd["op"] == "stop" and stopping is None:
                reason = cmd.get("reason") if isinstance(cmd.get("reason"), str) else "stopped by the cluster service"
                stopping = stop_in_background(reason[:200], 1e9)  # the service bounds it (it kills us)
            elif cmd["op"] == "kill":
                handle.kill()
            elif cmd["op"] == "gone" and stopping is None:
                # The service died: stop at the next step boundary with the state written; a
                # restarted service resumes the job from it (and kills us if this takes long).
                stopping = stop_in_background("the cluster service is gone", 120.0)
        except Exception as exc:  # noqa: BLE001 - a command that cannot be carried out now
            send({"kind": "note", "text": f"{cmd.get('op') if cmd else '?'} not done: {_why(exc)}"})
        now = time.monotonic()
        st = status()
        if st != last or now - sent_s >= 1.0:
            send({"kind": "status", "status": st})
            last, sent_s = st, now
    try:
        result = handle.wait(0)
    except BaseException as exc:  # noqa: BLE001 - the job failed: one line to the service
        text = _why(exc)
        send({"kind": "error", "error": text, "disk_full": _disk_full(exc, text)})
        return 0
    loss = result.history[-1].get("loss") if result.history else None
    send({"kind": "status", "status": status()})
    send({"kind": "result", "steps": int(result.steps), "stopped": bool(result.stopped), "loss": loss})
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not (argv[1].isdigit() and argv[2].isdigit()):
        print("usage: python -m virtualflow.service.launcher CMD_FD MSG_FD (started by the cluster service)",
              file=sys.stderr)
        return 2
    cmd_fd, msg_fd = int(argv[1]), int(argv[2])
    for fd in (cmd_fd, msg_fd):
        os.set_inheritable(fd, False)  # the job's workers get neither pipe
    return driver_main(cmd_fd, msg_fd)


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (the job's threads, gloo's): everything is reported and written.
    os._exit(code)
