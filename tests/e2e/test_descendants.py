"""A worker's descendants end with it (backends/descendants.py), daemons that left its process
group included: checked on a real process tree (a harness process stands for the worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import process_alive as _alive
from virtualflow.backends.descendants import descendants

HARNESS = r"""
import subprocess, sys, time
from virtualflow.backends.descendants import end_descendants, keep_descendants
keep = sys.argv[1] == "keep"
if keep:
    assert keep_descendants()
# a daemon: its own session, its parent (the shell) gone at once
out = subprocess.run(["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 </dev/null & echo $!"],
                     capture_output=True, text=True, check=True)
daemon = int(out.stdout)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
print(daemon, child, flush=True)
sys.stdin.readline()  # the test looks at the tree meanwhile
killed = end_descendants(timeout_s=30)
print(" ".join(map(str, sorted(killed))), flush=True)
"""




def _run(mode: str) -> tuple[int, int, list[int], list[int], bool, bool]:
    proc = subprocess.Popen([sys.executable, "-c", HARNESS, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    daemon = child = 0
    try:
        daemon, child = map(int, proc.stdout.readline().split())
        deadline = time.monotonic() + 30  # the shell that started the daemon exits, orphaning it
        while time.monotonic() < deadline and daemon not in descendants(proc.pid) and mode == "keep":
            time.sleep(0.05)
        tree = descendants(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        killed = [int(p) for p in proc.stdout.readline().split()]
        proc.wait(timeout=60)
        return daemon, child, tree, killed, _alive(daemon), _alive(child)
    finally:
        for pid in (daemon, child):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def test_a_subreaper_worker_keeps_and_ends_a_daemon_that_left_its_group():
    daemon, child, tree, killed, daemon_alive, child_alive = _run("keep")
    assert daemon in tree and child in tree  # the orphaned daemon came back to the worker
    assert daemon in killed and child in killed
    assert not daemon_alive and not child_alive


def test_without_the_subreaper_the_daemon_escapes_the_tree():
    """What the subreaper is for: without it the orphaned daemon is re-parented above the worker
    and no walk of the worker's tree finds it (only its direct child is ended)."""
    daemon, child, tree, killed, daemon_alive, child_alive = _run("plain")
    assert daemon not in tree and child in tree
    assert killed == [child] and daemon_alive and not child_alive


def test_descendants_reads_the_tree_from_proc(tmp_path):
    proc_dir = tmp_path / "proc"
    for pid, ppid, comm in [(10, 1, "init x"), (11, 10, "a) b"), (12, 11, "c"), (13, 1, "other"), (14, 12, "d")]:
        (proc_dir / str(pid)).mkdir(parents=True)
        (proc_dir / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 0 0\n")
    (proc_dir / "self").mkdir()
    assert descendants(10, proc=str(proc_dir)) == [11, 12, 14]
    assert descendants(13, proc=str(proc_dir)) == []
