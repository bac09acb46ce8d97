"""Signed control messages: HMAC-SHA256 with the job's secret token.

The job's TCPStore has no authentication: anyone who can reach its port can read and write any
key. What the coordinator *acts on* from outside its own process (a worker's join request, a
``virtualflow resize`` request) is therefore signed with the job's token, and what the
coordinator sends back to a joining worker (its id and configuration) is signed too.

A message is ``{"payload": {...}, "sig": HEX}`` where ``sig = HMAC-SHA256(token,
canonical_json(payload))`` and the payload carries a random ``nonce`` and the sender's ``time``.
Verification:

* compares signatures in constant time (:func:`hmac.compare_digest`);
* refuses a payload whose ``time`` is more than ``max_age_s`` away from the receiver's clock;
* with a :class:`ReplayGuard`, refuses a nonce seen before within that window (a captured
  message cannot be replayed: old ones fail the time check, recent ones the nonce check).

Pure: no I/O except the token file helpers at the bottom, no global state.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from typing import Any

MAX_AGE_S = 300.0
"""How far a message's time may be from the receiver's clock (skew between machines plus
transit); also how long a :class:`ReplayGuard` remembers a nonce."""


class AuthError(ValueError):
    """A message is unsigned, wrongly signed, too old or replayed; the message says which."""


def canonical(payload: dict[str, Any]) -> bytes:
    """The bytes that are signed: sorted keys, no whitespace, ASCII only."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _mac(token: str, payload: dict[str, Any]) -> str:
    return hmac.new(token.encode(), canonical(payload), hashlib.sha256).hexdigest()


def sign(token: str, payload: dict[str, Any], *, now: float | None = None) -> dict[str, Any]:
    """A signed message of ``payload`` plus a fresh ``nonce`` and ``time``."""
    if not token:
        raise ValueError("cannot sign with an empty token")
    body = dict(payload)
    body["nonce"] = secrets.token_hex(16)
    body["time"] = time.time() if now is None else now
    return {"payload": body, "sig": _mac(token, body)}


def verify(token: str, message: Any, *, max_age_s: float = MAX_AGE_S, now: float | None = None,
           guard: "ReplayGuard | None" = None) -> dict[str, Any]:
    """The payload of ``message`` if it is correctly signed with ``token``, fresh and (with
    ``guard``) not seen before; otherwise :class:`AuthError`."""
    if not isinstance(message, dict) or "sig" not in message or "payload" not in message:
        raise AuthError("unsigned message (no payload/sig envelope)")
    payload, sig = message["payload"], message["sig"]
    if not isinstance(payload, dict) or not isinstance(sig, str):
        raise AuthError("malformed signed message")
    try:
        expected = _mac(token, payload)
    except (TypeError, ValueError) as exc:
        raise AuthError(f"payload cannot be canonicalised: {exc}") from None
    if not hmac.compare_digest(expected, sig):
        raise AuthError("bad signature (not signed with this job's token, or altered)")
    t, nonce = payload.get("time"), payload.get("nonce")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not isinstance(nonce, str) or not nonce:
        raise AuthError("signed payload lacks a time or a nonce")
    now = time.time() if now is None else now
    if abs(now - t) > max_age_s:
        raise AuthError(f"message time is {now - t:+.0f} s from this clock (more than {max_age_s:g} s): stale or replayed")
    if guard is not None:
        guard.check(nonce, t, now=now)
    return payload


class ReplayGuard:
    """Remembers the nonces of accepted messages for ``window_s``; a repeat is refused."""

    def __init__(self, window_s: float = MAX_AGE_S) -> None:
        self.window_s = window_s
        self._seen: dict[str, float] = {}

    def check(self, nonce: str, t: float, *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if len(self._seen) > 1024:
            self._seen = {n: s for n, s in self._seen.items() if now - s <= 2 * self.window_s}
        if nonce in self._seen:
            raise AuthError(f"replayed message (nonce {nonce[:8]}... already used)")
        self._seen[nonce] = t


# -- token files -----------------------------------------------------------------------------
def new_token() -> str:
    return secrets.token_hex(32)


def write_token(path: str, token: str) -> None:
    """Write ``token`` to ``path``, readable by its owner only (mode 0600), atomically: a new file
    created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` is renamed into place
    (:func:`virtualflow.rundir.atomic_write`). A symbolic link (or anything but a regular file) at
    ``path`` is refused, never followed: a link planted there would have the token written, and
    its target's mode changed, wherever it points."""
    from virtualflow.rundir import atomic_write

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
