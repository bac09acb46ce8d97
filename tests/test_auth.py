"""Signed control messages (virtualflow.comm.auth): what verifies and what is refused."""

from __future__ import annotations

import copy
import os
import stat

import pytest

from virtualflow.comm import auth

TOKEN = "a" * 64


def test_signed_message_verifies_and_returns_payload_with_nonce_and_time():
    msg = auth.sign(TOKEN, {"op": "resize", "workers": 3})
    payload = auth.verify(TOKEN, msg)
    assert payload["op"] == "resize" and payload["workers"] == 3
    assert len(payload["nonce"]) == 32 and isinstance(payload["time"], float)


def test_signature_is_over_canonical_json_key_order_does_not_matter():
    msg = auth.sign(TOKEN, {"b": 1, "a": 2})
    msg["payload"] = dict(reversed(list(msg["payload"].items())))
    assert auth.verify(TOKEN, msg)["a"] == 2


@pytest.mark.parametrize("field, value", [("workers", 4), ("op", "stop"), ("time", 0.0), ("extra", 1)])
def test_tampered_payload_is_refused(field, value):
    msg = auth.sign(TOKEN, {"op": "resize", "workers": 3})
    bad = copy.deepcopy(msg)
    bad["payload"][field] = value
    with pytest.raises(auth.AuthError, match="bad signature"):
        auth.verify(TOKEN, bad)


def test_wrong_token_is_refused():
    msg = auth.sign("b" * 64, {"op": "join"})
    with pytest.raises(auth.AuthError, match="bad signature"):
        auth.verify(TOKEN, msg)


@pytest.mark.parametrize("message", [{"op": "resize", "workers": 3}, None, "text", {"payload": {}, "sig": 5},
                                     {"payload": [], "sig": "00"}])
def test_unsigned_or_malformed_message_is_refused(message):
    with pytest.raises(auth.AuthError):
        auth.verify(TOKEN, message)


def test_replayed_nonce_is_refused():
    guard = auth.ReplayGuard()
    msg = auth.sign(TOKEN, {"op": "resize", "workers": 3})
    auth.verify(TOKEN, msg, guard=guard)
    with pytest.raises(auth.AuthError, match="replayed"):
        auth.verify(TOKEN, copy.deepcopy(msg), guard=guard)
    auth.verify(TOKEN, auth.sign(TOKEN, {"op": "resize", "workers": 3}), guard=guard)  # a fresh one is fine


def test_stale_message_is_refused():
    msg = auth.sign(TOKEN, {"op": "resize"}, now=1000.0)
    with pytest.raises(auth.AuthError, match="stale"):
        auth.verify(TOKEN, msg, now=1000.0 + auth.MAX_AGE_S + 1)
    assert auth.verify(TOKEN, msg, now=1000.0 + 10)["op"] == "resize"


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
