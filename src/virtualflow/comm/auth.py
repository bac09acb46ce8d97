"""Signed messages: HMAC-SHA256 over the exact bytes of a JSON payload.

The job's TCPStore has no authentication: anyone who can reach its port can read and write any
key. So everything the job *acts on* from the store is signed, and what does not verify is
dropped (and logged by the reader, see :mod:`virtualflow.comm.rejects`):

* with the job's **token** (the secret in ``RUN_DIR/token`` or ``--token-file``): what comes from
  outside the run's own processes — a ``virtualflow resize`` request, an external worker's join
  request — and the coordinator's answer to a join;
* with the **run key** (:func:`run_key`, derived from the token and the job id): everything the
  run's own processes exchange — workers' reports, control commands, generation records, next
  pointers and abort flags. Workers the launcher starts get the run key in their configuration
  (over a pipe or Ray, never the store); external workers derive it from their token file. The
  token itself never travels.

Wire format: ``SIG.PAYLOAD`` (ASCII), ``SIG`` = 64 hex digits of ``HMAC-SHA256(key, PAYLOAD)``,
``PAYLOAD`` = the JSON object as sent. The MAC is checked over the raw bytes *before* anything is
parsed, so nothing from an unauthenticated sender reaches the JSON parser. Every payload names its
``kind`` (request, join, welcome, report, command, ...) and its ``job`` (a random id made once per
launch): a message signed for one channel or one job never verifies on another, so a captured
request cannot be replayed to a second job that shares the token file. Messages from outside the
run (``fresh=True``) also carry a random ``nonce`` and the sender's ``time``; verification then

* refuses a payload whose ``time`` is more than ``max_age_s`` away from the receiver's clock;
* with a :class:`ReplayGuard`, refuses a nonce seen before within that window.

The run's own channels replace freshness by binding: a report carries its worker's sequence
number, a command its sequence number, a record its generation (see
:mod:`virtualflow.comm.protocol`).

:func:`verify` raises :class:`AuthError` for every input that does not verify, whatever its
type, encoding or size. Pure: no I/O except the token file helpers at the bottom, no global
state.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import time
from typing import Any

MAX_AGE_S = 300.0
"""How far a message's time may be from the receiver's clock (skew between machines plus
transit); also how long a :class:`ReplayGuard` remembers a nonce."""

MAX_MESSAGE_BYTES = 1 << 20
"""Default bound on a signed message's size; readers pass a smaller one per channel."""

_SIG = re.compile(r"[0-9a-f]{64}")
_JOB_ID = re.compile(r"[0-9a-f]{8,64}")


class AuthError(ValueError):
    """A message is unsigned, wrongly signed, for another job or channel, too old or replayed;
    the message says which."""


def new_job_id() -> str:
    """A random id for one launch of a job (16 hex digits)."""
    return secrets.token_hex(8)


def is_job_id(text: Any) -> bool:
    return isinstance(text, str) and _JOB_ID.fullmatch(text) is not None


def run_key(token: str, job_id: str) -> str:
    """The key a run's own processes sign with: ``HMAC-SHA256(token, "virtualflow run key" +
    job_id)`` (hex). Knowing it signs nothing for another run, nor any request or join."""
    if not token:
        raise ValueError("cannot derive a run key from an empty token")
    return hmac.new(token.encode(), b"virtualflow run key\x00" + job_id.encode(), hashlib.sha256).hexdigest()


def _mac(key: str, data: bytes) -> str:
    return hmac.new(key.encode(), data, hashlib.sha256).hexdigest()


def sign(key: str, payload: dict[str, Any], *, job: str, kind: str, fresh: bool = True,
         now: float | None = None) -> str:
    """The signed message (``SIG.PAYLOAD``) of ``payload`` plus its ``kind`` and ``job`` (and,
    when ``fresh``, a random ``nonce`` and the current ``time``)."""
    if not key:
        raise ValueError("cannot sign with an empty key")
    body = dict(payload)
    body["kind"] = kind
    body["job"] = job
    if fresh:
        body["nonce"] = secrets.token_hex(16)
        body["time"] = time.time() if now is None else now
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=True)
    return _mac(key, text.encode("ascii")) + "." + text


def payload_of(message: str) -> dict[str, Any]:
    """The payload of a message this process signed itself (its nonce, say); not a check."""
    return json.loads(message.partition(".")[2])


def verify(key: str, message: Any, *, job: str, kind: str, fresh: bool = True, max_age_s: float = MAX_AGE_S,
           now: float | None = None, guard: "ReplayGuard | None" = None,
           max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """The payload of ``message`` (``str`` or ``bytes``) if it is signed with ``key``, for this
    ``job`` and ``kind``, at most ``max_bytes`` long and (when ``fresh``) recent and, with
    ``guard``, not seen before; otherwise :class:`AuthError`, whatever is wrong with it."""
    try:
        return _verify(key, message, job, kind, fresh, max_age_s, now, guard, max_bytes)
    except AuthError:
        raise
    except Exception as exc:  # noqa: BLE001 - every malformed input is a refusal, never a crash
        raise AuthError(f"malformed message ({type(exc).__name__})") from None


def _verify(key: str, message: Any, job: str, kind: str, fresh: bool, max_age_s: float, now: float | None,
            guard: "ReplayGuard | None", max_bytes: int) -> dict[str, Any]:
    if not isinstance(key, str) or not key:
        raise AuthError("no key to verify with")
    if isinstance(message, (bytes, bytearray, memoryview)):
        raw = bytes(message)
    elif isinstance(message, str):
        raw = message.encode("utf-8", "surrogatepass")
    else:
        raise AuthError(f"unsigned message (a {type(message).__name__}, not SIG.PAYLOAD text)")
    if len(raw) > max_bytes:
        raise AuthError(f"message of {len(raw)} bytes is over the {max_bytes}-byte limit of this channel")
    sig, dot, body = raw.partition(b".")
    if not dot or len(sig) != 64 or not raw.isascii() or not _SIG.fullmatch(sig.decode("ascii")):
        raise AuthError("unsigned message (not SIG.PAYLOAD with a 64-hex-digit HMAC)")
    if not hmac.compare_digest(_mac(key, body), sig.decode("ascii")):
        raise AuthError("bad signature (not signed with this job's key, or altered)")
    try:
        payload = json.loads(body.decode("ascii"))
    except (ValueError, RecursionError):
        raise AuthError("signed payload is not JSON") from None
    if not isinstance(payload, dict):
        raise AuthError("signed payload is not a JSON object")
    if payload.get("kind") != kind:
        raise AuthError(f"a signed {str(payload.get('kind'))[:20]!r} message where a {kind!r} one belongs")
    if payload.get("job") != job:
        raise AuthError(f"signed for job {str(payload.get('job'))[:20]!r}, not this job ({job}): "
                        f"captured from another run")
    if fresh:
        t, nonce = payload.get("time"), payload.get("nonce")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t != t or not isinstance(nonce, str) or not nonce:
            raise AuthError("signed payload lacks a time or a nonce")
        now = time.time() if now is None else now
        if abs(now - t) > max_age_s:
            raise AuthError(f"message time is {now - t:+.0f} s from this clock (more than {max_age_s:g} s): "
                            f"stale or replayed")
        if guard is not None:
            guard.check(nonce, t, now=now)
    return payload


class ReplayGuard:
    """Remembers the nonces of accepted messages for ``window_s``; a repeat is refused. Only
    verified messages reach it; at most ``max_entries`` are remembered at once (beyond that, new
    messages are refused until old ones expire: a flood needs the token)."""

    def __init__(self, window_s: float = MAX_AGE_S, max_entries: int = 100_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: set[str] = set()
        self._order: collections.deque[tuple[float, str]] = collections.deque()

    def __len__(self) -> int:
        """Nonces remembered now."""
        return len(self._seen)

    def check(self, nonce: str, t: float, *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        # A nonce is kept until its message could no longer pass the time check.
        while self._order and self._order[0][0] < now:
            self._seen.discard(self._order.popleft()[1])
        if nonce in self._seen:
            raise AuthError(f"replayed message (nonce {nonce[:8]}... already used)")
        if len(self._seen) >= self.max_entries:
            raise AuthError(f"more than {self.max_entries} signed messages within {self.window_s:g} s: refused")
        self._seen.add(nonce)
        expiry = max(t, now) + self.window_s
        if self._order and expiry < self._order[-1][0]:
            expiry = self._order[-1][0]  # keep the deque sorted (clocks of senders differ)
        self._order.append((expiry, nonce))


# -- token files -----------------------------------------------------------------------------
def new_token() -> str:
    return secrets.token_hex(32)


def write_token(path: str, token: str) -> None:
    """Write ``token`` to ``path``, readable by its owner only (mode 0600), atomically: a new file
    created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` is renamed into place
    (:func:`virtualflow.records.rundir.atomic_write`). A symbolic link (or anything but a regular file) at
    ``path`` is refused, never followed: a link planted there would have the token written, and
    its target's mode changed, wherever it points."""
    from virtualflow.records.rundir import atomic_write

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise ValueError(f"refusing to write the job's token to {path}: it is {kind}, which someone else may have "
                         f"put there; remove it (rm {path}) or choose another run directory (--run-dir)")
    atomic_write(path, (token + "\n").encode(), mode=0o600)


def read_token(path: str, *, private: bool = False) -> str:
    """The token in ``path`` (surrounding whitespace stripped); at least 16 characters. With
    ``private``, a file that group or others may access is refused, naming the ``chmod`` fix
    (the mode is checked on the file that is read, not on the name)."""
    try:  # O_NONBLOCK: a FIFO planted under the name must not hang the caller
        f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb")
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path!r}: {exc.strerror or exc}") from None
    with f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"the token file {path!r} is not a regular file; give a file holding the token")
        if private and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"the token file {path} may be accessed by other users (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}), and whoever reads it can control the job (resize "
                             f"it, join it as a worker): chmod 600 {path}")
        raw = f.read(4097)
    if len(raw) > 4096:
        raise ValueError(f"the token file {path!r} is over 4096 bytes; a token file holds one token")
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"the token file {path!r} is not text; a token file holds one token") from None
    if len(token) < 16:
        raise ValueError(f"the token file {path!r} holds {len(token)} characters; a token needs at least 16 "
                         f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))' > {path})")
    return token


def token_file_is_private(path: str) -> bool:
    """False when group or others may read ``path``."""
    return not (os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO))
