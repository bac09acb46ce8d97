"""State files on disk: a symbolic link is never followed, and a write interrupted by a kill leaves
nothing behind once the next state is written.

The interrupted write is real: a child process starts :func:`virtualflow.records.rundir.atomic_write` of
a state file and SIGKILLs itself half-way, as a worker killed while checkpointing does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from virtualflow.launching.resume import find_resume_state
from virtualflow.runtime.checkpoint import STALE_TEMP_S, UntrustedStateError, load_state, save_state

import jobs


def _state(step: int) -> dict:
    return {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * step}, "optimizer": {"state": {}},
            "lr_scheduler": None, "step": step, "job": {"name": "t"}}


def test_a_state_file_that_is_a_symbolic_link_is_refused_in_one_line(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_state(str(elsewhere / "real.pt"), _state(3))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    link = run_dir / "final.pt"
    link.symlink_to(elsewhere / "real.pt")
    with pytest.raises(UntrustedStateError) as refused:
        load_state(str(link))
    message = str(refused.value)
    assert "\n" not in message
    assert re.search(rf"refusing to read {re.escape(str(link))}: it is a symbolic link \(to '.*real\.pt'\)", message)
    assert "resume" in message  # the knob
    with pytest.raises(UntrustedStateError, match="symbolic link"):
        find_resume_state(str(run_dir), jobs.elastic_job())  # a resume refuses it too, rather than skipping to another state
    # The file itself is still read, and a link to a directory or a missing file is refused alike.
    assert load_state(str(elsewhere / "real.pt"))["step"] == 3
    (run_dir / "checkpoint.pt").symlink_to(tmp_path / "missing.pt")
    with pytest.raises(UntrustedStateError, match="symbolic link"):
        load_state(str(run_dir / "checkpoint.pt"))


_KILLED_WRITER = """
import os, signal, sys
from virtualflow.records.rundir import atomic_write

def write(f):
    f.write(b"half a state " * 1000)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # killed before the rename

atomic_write(sys.argv[1], write)
"""


def test_a_write_killed_before_its_rename_leaves_a_temporary_that_the_next_write_removes(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(folder / "step-00000004.pt")], timeout=120)
    assert done.returncode == -signal.SIGKILL
    left = [n for n in os.listdir(folder) if n.startswith(".step-00000004.pt.tmp-")]
    assert len(left) == 1 and not (folder / "step-00000004.pt").exists()
    # A live writer's temporary (this process's own) stays; one untouched for STALE_TEMP_S goes.
    live = folder / f".step-00000005.pt.tmp-{os.getpid()}-0123abcd"
    live.write_bytes(b"being written")
    old = folder / f".final.pt.tmp-{os.getpid()}-89abcdef"
    old.write_bytes(b"abandoned long ago")
    long_ago = time.time() - STALE_TEMP_S - 60
    os.utime(old, (long_ago, long_ago))
    unrelated = folder / ".notes.tmp-1-00000000"  # not a state file's temporary
    unrelated.write_bytes(b"")

    save_state(str(folder / "step-00000006.pt"), _state(6))

    assert sorted(os.listdir(folder)) == sorted([live.name, unrelated.name, "step-00000006.pt"])
    assert load_state(str(folder / "step-00000006.pt"))["step"] == 6
