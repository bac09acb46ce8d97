"""Signed messages (virtualflow.comm.auth): what verifies and what is refused."""

from __future__ import annotations

import json
import os
import stat

import pytest

from virtualflow.comm import auth

TOKEN = "a" * 64
JOB = "0123456789abcdef"


def sign(payload: dict, **kw) -> str:
    return auth.sign(TOKEN, payload, job=JOB, kind="request", **kw)


def verify(message, **kw) -> dict:
    return auth.verify(TOKEN, message, job=JOB, kind="request", **kw)


def test_signed_message_verifies_and_returns_payload_with_kind_job_nonce_and_time():
    msg = sign({"op": "resize", "workers": 3})
    assert isinstance(msg, str) and msg.isascii()
    payload = verify(msg)
    assert payload["op"] == "resize" and payload["workers"] == 3
    assert payload["kind"] == "request" and payload["job"] == JOB
    assert len(payload["nonce"]) == 32 and isinstance(payload["time"], float)
    assert verify(msg.encode()) == payload  # as the store hands it back: bytes


@pytest.mark.parametrize("field, value", [("workers", 4), ("op", "stop"), ("time", 0.0), ("extra", 1),
                                          ("job", "fedcba9876543210")])
def test_tampered_payload_is_refused(field, value):
    sig, _, text = sign({"op": "resize", "workers": 3}).partition(".")
    body = json.loads(text)
    body[field] = value
    with pytest.raises(auth.AuthError, match="bad signature"):
        verify(sig + "." + json.dumps(body))


def test_wrong_token_is_refused():
    msg = auth.sign("b" * 64, {"op": "join"}, job=JOB, kind="request")
    with pytest.raises(auth.AuthError, match="bad signature"):
        verify(msg)


def test_a_message_for_another_job_or_channel_is_refused():
    other_job = auth.sign(TOKEN, {"op": "resize", "workers": 3}, job="fedcba9876543210", kind="request")
    with pytest.raises(auth.AuthError, match="another run"):
        verify(other_job)  # captured from a job that shares the token file
    join = auth.sign(TOKEN, {"op": "join"}, job=JOB, kind="join")
    with pytest.raises(auth.AuthError, match="'join' message where a 'request'"):
        verify(join)


@pytest.mark.parametrize("message", [
    {"op": "resize", "workers": 3}, None, 5, ["x"], "text", b"",
    json.dumps({"payload": {"op": "resize"}, "sig": "00"}),  # the old envelope
    "\u00e9" * 64 + "." + "{}",  # a non-ASCII signature (compare_digest raised TypeError on it)
    ("\u00e9" * 64 + ".{}").encode("utf-8"),
    b"\xff\xfe" * 40 + b".{}",  # not UTF-8 at all
    "0" * 63 + ".{}", "G" * 64 + ".{}", "0" * 64 + "{}",
])
def test_unsigned_or_malformed_message_is_refused_as_an_auth_error(message):
    with pytest.raises(auth.AuthError):
        verify(message)


def test_oversized_message_is_refused_before_its_signature_is_checked():
    msg = sign({"op": "resize", "pad": "x" * 5000})
    with pytest.raises(auth.AuthError, match="over the 1000-byte limit"):
        verify(msg, max_bytes=1000)
    assert verify(msg, max_bytes=10_000)["pad"] == "x" * 5000


def test_no_key_or_a_key_of_the_wrong_type_is_an_auth_error():
    msg = sign({"op": "resize"})
    for key in ("", None, 5):
        with pytest.raises(auth.AuthError):
            auth.verify(key, msg, job=JOB, kind="request")


def test_replayed_nonce_is_refused():
    guard = auth.ReplayGuard()
    msg = sign({"op": "resize", "workers": 3})
    verify(msg, guard=guard)
    with pytest.raises(auth.AuthError, match="replayed"):
        verify(msg, guard=guard)
    verify(sign({"op": "resize", "workers": 3}), guard=guard)  # a fresh one is fine


def test_replay_guard_forgets_nonces_once_their_messages_are_stale():
    guard = auth.ReplayGuard(window_s=10.0, max_entries=3)
    for i in range(3):
        guard.check(f"n{i}", 100.0, now=100.0)
    with pytest.raises(auth.AuthError, match="more than 3"):
        guard.check("n3", 100.0, now=101.0)
    guard.check("n3", 100.0, now=111.0)  # the first three expired and are forgotten
    assert len(guard) == 1


def test_stale_message_is_refused():
    msg = sign({"op": "resize"}, now=1000.0)
    with pytest.raises(auth.AuthError, match="stale"):
        verify(msg, now=1000.0 + auth.MAX_AGE_S + 1)
    assert verify(msg, now=1000.0 + 10)["op"] == "resize"


def test_run_key_is_per_job_and_not_the_token():
    a, b = auth.run_key(TOKEN, JOB), auth.run_key(TOKEN, "fedcba9876543210")
    assert a != b and TOKEN not in (a, b) and len(a) == 64
    assert auth.run_key(TOKEN, JOB) == a
    assert auth.is_job_id(auth.new_job_id()) and not auth.is_job_id("x") and not auth.is_job_id(None)


def test_token_file_is_written_private_and_read_back(tmp_path):
    path = str(tmp_path / "token")
    open(path, "w").close()
    os.chmod(path, 0o644)
    token = auth.new_token()
    auth.write_token(path, token)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert auth.token_file_is_private(path)
    assert auth.read_token(path) == token and len(token) == 64


def test_short_or_missing_token_file_is_a_clear_error(tmp_path):
    path = tmp_path / "token"
    path.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16"):
        auth.read_token(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        auth.read_token(str(tmp_path / "missing"))
