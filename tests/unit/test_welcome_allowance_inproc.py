"""The external backend's default welcome allowance, without processes.

tests/e2e/test_hangs.py shortens the allowance to see a welcomed, silent joiner fenced within
seconds; the default it replaces is pinned here: a welcomed worker has at least 30 s, or ten
heartbeat timeouts, to send its first beat (a worker's start-up on a loaded machine)."""

from __future__ import annotations

from virtualflow.backends.external import ExternalBackend


def test_the_welcome_allowance_is_30_s_or_ten_heartbeat_timeouts_whichever_is_longer():
    assert ExternalBackend(("127.0.0.1", 0), silence_s=2.0).welcome.first_beat_s == 30.0
    assert ExternalBackend(("127.0.0.1", 0), silence_s=5.0).welcome.first_beat_s == 50.0
    assert ExternalBackend(("127.0.0.1", 0), silence_s=2.0, first_beat_s=3.0).welcome.first_beat_s == 3.0
