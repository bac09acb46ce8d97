"""The run directory: one place that reads and writes its records, guards it and sets old runs aside.

Writers: :func:`atomic_write` (the one way a record, a state file or the token is written: a
temporary file in the same directory, fsynced, renamed over the target, the directory fsynced;
the temporary file is removed if anything fails, so a reader sees the old file or the new one,
never a mix, and a crash leaves no half-written file under the real name) and :func:`write_json`.
Every JSON record is standard JSON: a non-finite number (a NaN loss) is written as the string
``"nan"``, ``"inf"`` or ``"-inf"`` (:func:`json_text`), and the readers turn it back into a float.
Readers: :func:`read_jsonl` (tolerates a partial last line, as a crash mid-write leaves),
:func:`read_status` and :func:`read_summary` (a truncated or half-written file is a
``ValueError`` that names the file and says to retry, never a JSON traceback), :func:`run_state`.
Used by the job handle, ``status``, ``resize`` and ``plot``: nothing else opens these files.

A full disk: every write through here that fails for lack of space is a :class:`DiskFullError`
(the file, the space free there, the space needed when known); :func:`no_space` finds the
``ENOSPC`` behind another library's error.

Guards (used by :func:`virtualflow.launch` before a run writes anything):

* :func:`make_private_dir` creates a run directory ``0700``; an existing one that is a symbolic
  link, belongs to another user or is writable by group or others is refused (whoever can write
  there could replace the states a resume loads, or the token).
* :class:`RunLock`: ``RUN_DIR/coordinator.lock``, held with ``fcntl.flock`` by the coordinator's
  process for the whole run. A second run in the same directory is refused, naming the holder's
  pid. The kernel drops the lock when its process dies, so a lock file left by a crash never
  blocks a resume.
* :func:`earlier_run` / :func:`set_aside`: what an earlier run left (states and records), moved
  as a whole into ``RUN_DIR/previous-<time>/`` (never deleted) so that checkpoint retention and
  resume never mix two runs; :func:`trim_metrics` drops the metrics of steps a resumed run redoes.

A running job's launcher rewrites ``status.json`` about twice a second (state, step,
generation, workers, recent step times, and the coordinator's loopback address and pid). A
run is *finished* once ``summary.json`` exists or the state is final; a run whose coordinator
process is gone is *orphaned* (continue it with ``virtualflow run ... --resume RUN_DIR``).

Imports nothing from virtualflow, so every layer may write through it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import stat
import threading
import time
from typing import IO, Any, Callable

FINAL_STATES = ("done", "failed", "stopped")

STATE_FILES = ("final.pt", "checkpoint.pt")
"""State files at the top of a run directory (besides ``checkpoints/step-N.pt``)."""
IDENTITY_FILE = "job_identity.json"
"""Which job's run the directory holds (:mod:`virtualflow.launching.identity`)."""
RUN_FILES = ("final.pt", "final.pt.sha256", "checkpoint.pt", "checkpoint.pt.sha256", "checkpoints",
             "metrics.jsonl", "events.jsonl", "status.json", "summary.json", "token", "logs", "tensorboard", "profile",
             IDENTITY_FILE)
"""Everything a run writes in its directory (besides its lock); what :func:`set_aside` moves."""
LOCK_FILE = "coordinator.lock"


# -- a full disk -------------------------------------------------------------------------------
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A write failed for lack of space (``ENOSPC``, or ``EDQUOT``: a quota): names the file, the
    space free on its filesystem and, when known, the space the write needed. What was written
    before stays (writes are atomic: the failed one left nothing under the file's name)."""

    def __init__(self, path: str, free_bytes: int | None, needed_bytes: int | None = None,
                 code: int = errno.ENOSPC) -> None:
        super().__init__(code, os.strerror(code), path)
        self.path, self.free_bytes, self.needed_bytes = path, free_bytes, needed_bytes

    def __str__(self) -> str:
        free = "unknown space" if self.free_bytes is None else format_bytes(self.free_bytes)
        need = f"; it needs about {format_bytes(self.needed_bytes)}" if self.needed_bytes else ""
        where = "in " if os.path.isdir(self.path) else ""  # a file of that directory, not known which
        return f"{self.strerror} writing {where}{self.path} ({free} free there{need})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (DiskFullError, (self.path, self.free_bytes, self.needed_bytes, self.errno))


def format_bytes(n: int) -> str:
    """``n`` bytes for a person: ``512 B``, ``3.4 KiB``, ``120.0 MiB``, ``2.5 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop returns


def free_bytes(path: str) -> int | None:
    """Space free to this user on the filesystem that holds ``path`` (or its nearest existing
    parent); None when it cannot be told."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def no_space(exc: BaseException | None) -> OSError | None:
    """The ``ENOSPC``/``EDQUOT`` error behind ``exc``, following ``__cause__`` and ``__context__``
    (a library may turn one into its own error: ``torch.save`` raises a ``RuntimeError`` while
    handling it); None when lack of space is not what failed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def disk_full_error(exc: BaseException, path: str, needed_bytes: int | None = None) -> DiskFullError | None:
    """A :class:`DiskFullError` for writing ``path`` when ``exc`` comes from a lack of space,
    else None."""
    cause = no_space(exc)
    if cause is None:
        return None
    if isinstance(cause, DiskFullError):
        return cause
    return DiskFullError(path, free_bytes(path), needed_bytes, cause.errno)


# -- writing ----------------------------------------------------------------------------------
def atomic_write(path: str, data: bytes | Callable[[IO[bytes]], None], *, mode: int = 0o644) -> None:
    """Write ``data`` (bytes, or a function that writes to a binary file) to ``path`` atomically.

    The temporary file is created next to ``path`` with ``O_EXCL | O_NOFOLLOW`` and ``mode`` (a
    name planted there beforehand, a symbolic link included, makes this fail instead of being
    followed), flushed and fsynced, then renamed over ``path`` (a rename replaces a link named
    ``path`` itself, never its target); then the directory is fsynced so that the rename
    survives a power cut. On any failure the temporary file is removed and the error raised;
    ``path`` is then untouched. A failure for lack of space is a :class:`DiskFullError` naming
    ``path`` (and how many bytes it needed, when ``data`` is bytes)."""
    folder, name = os.path.split(os.path.abspath(path))
    # A hidden name that no reader lists (it does not end in .pt or .json).
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        full = disk_full_error(exc, path, None if callable(data) else len(data))
        if full is not None:
            raise full from exc
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        # After the partial file is gone: the free space reported is what the next try has.
        full = disk_full_error(exc, path, None if callable(data) else len(data))
        if full is not None:
            raise full from exc
        raise
    _fsync_dir(folder)


_TEMPORARY = re.compile(r"\.(?P<target>.+)\.tmp-(?P<pid>\d{1,10})-[0-9a-f]{8}")


def temporary_of(name: str) -> tuple[str, int] | None:
    """``(target, writer pid)`` when ``name`` is a temporary :func:`atomic_write` makes
    (``.TARGET.tmp-PID-HEX``), else None: the one place that reads that naming."""
    found = _TEMPORARY.fullmatch(name)
    return None if found is None else (found.group("target"), int(found.group("pid")))


def remove_temporaries(folder: str, pids: set[int]) -> list[str]:
    """Remove the temporary files :func:`atomic_write` calls of processes ``pids`` left in
    ``folder`` (a writer killed mid-write leaves its ``.NAME.tmp-PID-HEX``; on a full disk that
    is space the next run needs). Only for processes known to be gone: a live writer's file is
    the one it is about to rename. Returns the names removed."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        found = temporary_of(name)
        if found is not None and found[1] in pids:
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the rename is done either way
        pass
    finally:
        os.close(fd)


# -- JSON text ----------------------------------------------------------------------------------
# Python's json writes NaN and infinities as the bare tokens NaN/Infinity, which are not JSON:
# jq, JavaScript and strict parsers refuse the whole file. Every record here writes them as the
# strings "nan", "inf" and "-inf" instead (what float() reads back), and the readers below turn
# those strings back into floats, so a Python reader sees the same numbers as before.
NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
"""How a non-finite number is written in the run directory's JSON (the string) and read back."""


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists and tuples, at any depth) replaced
    by its string in :data:`NONFINITE`; everything else as it is."""
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_text(data: Any, indent: int | None = None) -> str:
    """``data`` as standard JSON (non-finite numbers as strings: :func:`json_safe`). Most
    records hold none: they are written as they are, and only a record that json refuses for a
    non-finite number is walked and rewritten (a step record of 4,096 VNs: 10 ms of Python for
    the walk, 1 ms for json's own encoder)."""
    try:
        return json.dumps(data, indent=indent, allow_nan=False)
    except ValueError:  # a non-finite float somewhere (json's only ValueError for data like ours)
        return json.dumps(json_safe(data), indent=indent, allow_nan=False)


def restore_numbers(value: Any) -> Any:
    """The inverse of :func:`json_safe` for what a reader loaded: the strings ``"nan"``,
    ``"inf"`` and ``"-inf"`` (values, at any depth; never keys) become floats again."""
    if isinstance(value, str):
        return NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: restore_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_numbers(v) for v in value]
    return value


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (readers see the old or the new file);
    non-finite numbers as strings (:func:`json_safe`)."""
    atomic_write(path, json_text(data, indent=2).encode())


# -- guarding the directory -------------------------------------------------------------------
def make_private_dir(path: str) -> bool:
    """Create the run directory ``path`` with mode 0700 (its parents as usual); returns True if
    it was created. An existing ``path`` must be a real directory (not a symbolic link) of this
    user that neither group nor others may write: anything else is a ``ValueError`` naming it
    and the fix."""
    path = os.path.normpath(path)  # "link/" would make lstat follow the link
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            st = os.lstat(path)  # created by someone else meanwhile: judged below
        else:
            os.chmod(path, 0o700)  # whatever the umask
            return True
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"the run directory {path} is a symbolic link (to {os.readlink(path)}); a link could send "
                         f"the run's token and states elsewhere: pass the real directory, or choose another run "
                         f"directory (--run-dir)")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"the run directory {path} exists and is not a directory; choose another run directory "
                         f"(--run-dir)")
    if st.st_uid != os.geteuid():
        raise ValueError(f"the run directory {path} belongs to another user (uid {st.st_uid}); whoever owns it "
                         f"can replace its states and token: choose a directory of your own (--run-dir)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit)
        raise ValueError(f"the run directory {path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}); "
                         f"anyone who can write there can replace the states a resume loads or the token: "
                         f"chmod 700 {path}, or choose another run directory (--run-dir)")
    return False


class RunLock:
    """``RUN_DIR/coordinator.lock``, held (``fcntl.flock``, exclusive) by the process whose
    coordinator runs the job in that directory, from before it writes anything there until the
    run has ended. The file holds the owner's pid, host and start time, for the message that
    refuses a second run; the lock itself, not the file, is what counts: the kernel releases it
    when the process dies, so a file left by a crash (or a reused pid) never blocks a resume."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd = path, fd
        self._releasing = threading.Lock()  # the launcher and the run's monitor thread may both release

    @classmethod
    def acquire(cls, run_dir: str) -> "RunLock":
        """Hold ``run_dir``'s lock, or ``ValueError`` naming the directory and the holder's pid."""
        path = os.path.join(run_dir, LOCK_FILE)
        for _ in range(20):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
            except OSError as exc:
                raise ValueError(f"cannot open the run directory's lock file {path}: {exc.strerror or exc}; "
                                 f"remove it if it is not a regular file, or choose another run directory "
                                 f"(--run-dir)") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _lock_holder(fd)
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise
                pid = holder.get("pid", "unknown")
                since = holder.get("started")
                when = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" \
                    if isinstance(since, (int, float)) and not isinstance(since, bool) else ""
                host = f" on {holder['host']}" if isinstance(holder.get("host"), str) else ""
                raise ValueError(
                    f"the run directory {run_dir} is in use by a running job (coordinator pid {pid}{host}{when}); "
                    f"a second run there would overwrite its records and token: choose another run directory "
                    f"(--run-dir), or wait for that job to end (virtualflow status {run_dir})") from None
            # A releasing owner unlinks the file: the lock must be on the file that is there now.
            try:
                current = os.lstat(path)
            except FileNotFoundError:
                current = None
            if current is not None and os.path.samestat(os.fstat(fd), current):
                record = json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "started": time.time()})
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, record.encode(), 0)
                except OSError as exc:  # a full disk: leave nothing behind, say what failed
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                    os.close(fd)
                    full = disk_full_error(exc, path, len(record))
                    if full is not None:
                        raise full from exc
                    raise
                return cls(path, fd)
            os.close(fd)
        raise RuntimeError(f"could not take the lock {path}: it keeps being replaced")

    def release(self) -> None:
        """Give the directory up (idempotent). The file is removed first, then the lock dropped."""
        with self._releasing:
            if self._fd is None:
                return
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)  # drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _lock_holder(fd: int) -> dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def earlier_run(run_dir: str) -> list[str]:
    """The names of :data:`RUN_FILES` an earlier run left in ``run_dir``."""
    return [name for name in RUN_FILES if os.path.lexists(os.path.join(run_dir, name))]


def state_files(run_dir: str) -> list[str]:
    """The state files (``final.pt``, ``checkpoint.pt``, ``checkpoints/step-N.pt``) in ``run_dir``,
    relative to it."""
    found = [name for name in STATE_FILES if os.path.lexists(os.path.join(run_dir, name))]
    folder = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(folder):
        found += sorted(os.path.join("checkpoints", f) for f in os.listdir(folder)
                        if f.startswith("step-") and f.endswith(".pt"))
    return found


def set_aside(run_dir: str, names: list[str]) -> str:
    """Move ``names`` (files and folders of ``run_dir``) into a new ``run_dir/previous-<time>/``
    (mode 0700); returns its path. Nothing is deleted."""
    stem = os.path.join(run_dir, f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
    dest, n = stem, 1
    while True:
        try:
            os.mkdir(dest, 0o700)
            break
        except FileExistsError:
            n += 1
            dest = f"{stem}-{n}"
    for name in names:
        os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    _fsync_dir(run_dir)
    return dest


def trim_metrics(run_dir: str, before_step: int) -> int:
    """Drop from ``run_dir/metrics.jsonl`` the records of steps ``>= before_step`` (a resumed run
    redoes them and writes them again) and any partial line; returns how many lines went."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not line.endswith(b"\n") or not isinstance(record, dict):
            continue
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= before_step:
            continue
        kept.append(line)
    dropped = len(lines) - len(kept)
    if dropped:
        atomic_write(path, b"".join(kept))
    return dropped


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None (missing, unreadable, or not an object): records another
    process writes are read defensively."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply to be a record
        return None
    return restore_numbers(data) if isinstance(data, dict) else None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every record of a JSONL file ([] if it does not exist). A line that is not a JSON object
    (a partial last line after a crash) is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(restore_numbers(record))
    return out


def _read_record(path: str, what: str) -> dict[str, Any]:
    """One JSON object from ``path``; a file that is not one is a ``ValueError`` naming it."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        record = json.loads(text)
    except ValueError as exc:
        # A writer that is not atomic (or was killed mid-write, or a copy in progress) leaves a
        # prefix of the record: say so instead of showing a decoder traceback.
        where = f"line {exc.lineno}, column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "?"
        raise ValueError(
            f"{path} is not complete JSON ({len(text)} bytes, unreadable at {where}): it may be in the "
            f"middle of being rewritten; retry in a moment"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds a JSON {type(record).__name__}, not a run's {what} (a JSON object)")
    return restore_numbers(record)


def read_status(run_dir: str) -> dict[str, Any]:
    """The run's ``status.json``. A missing directory or file, or a truncated or partial file
    (caught while being rewritten), is a ``ValueError`` that says what to do."""
    path = os.path.join(run_dir, "status.json")
    if not os.path.isdir(run_dir):
        raise ValueError(f"run directory {run_dir!r} does not exist; pass the --run-dir of a 'virtualflow run'")
    if not os.path.exists(path):
        raise ValueError(
            f"{run_dir!r} is not a virtualflow run directory (no status.json); pass the --run-dir of a "
            f"'virtualflow run'"
        )
    return _read_record(path, "status")


def read_summary(run_dir: str) -> dict[str, Any] | None:
    """The run's ``summary.json`` (written when the run ends), or None while it has none."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return None
    return _read_record(path, "summary")


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_state(run_dir: str, status: dict[str, Any]) -> str:
    """running | finished (done/failed/stopped) | orphaned."""
    if os.path.exists(os.path.join(run_dir, "summary.json")) or status.get("state") in FINAL_STATES:
        return "finished"
    if not pid_alive(status.get("coordinator", {}).get("pid")):
        return "orphaned"
    return "running"
