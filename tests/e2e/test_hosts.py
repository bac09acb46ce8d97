"""Hosts on one machine (tests/hosts.py), and virtualflow across them.

The harness first: hosts reach each other and nothing else, rate limits and partitions act on
the link, a host dies whole, and nothing (namespace, veth, bridge, process) is left behind however
the test that built the hosts ends. Then multi-node runs across the hosts, each against a
1-worker deterministic run on this machine, bit for bit: external workers joining a coordinator
in another host with the job's token, and a Ray cluster of three hosts (head in one, ``ray start
--address`` in two) whose job's workers land on different hosts. Every test skips with one line
where network namespaces cannot be built (no root, no iproute2).

The machine's host name resolves to 127.0.0.1 here (as on many), so gloo's own choice of
address would advertise loopback to the other hosts and fail; what makes these runs cross the
hosts' links is the workers' ``interface`` setting: its default ``auto`` (the address that
reaches the store) on Ray, and on the external workers the two other ways to give it (a
machine's ``GLOO_SOCKET_IFNAME``, ``virtualflow worker --interface``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import hosts as H
from hosts import hosts, make_hosts  # noqa: F401 - fixtures

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
PY = sys.executable
VF = [PY, "-m", "virtualflow.cli.main"]
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(TESTS)]), "OMP_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1"}
JOB = f"{TESTS / 'jobs.py'}:make_job"
STEPS = 6

SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5000)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); t = time.perf_counter(); n = 0
while True:
    b = c.recv(1 << 16)
    if not b: break
    n += len(b)
print(n, time.perf_counter() - t, flush=True)
"""
CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5000), timeout=float(sys.argv[3]))
s.sendall(b"x" * int(sys.argv[2])); s.close()
"""


def _serve(host: H.Host) -> subprocess.Popen:
    p = host.run([PY, "-c", SERVER, host.ip], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _send(src: H.Host, dst: H.Host, nbytes: int, timeout_s: float = 10.0) -> None:
    src.check_output([PY, "-c", CLIENT, dst.ip, str(nbytes), str(timeout_s)])


def _received(srv: subprocess.Popen) -> tuple[int, float]:
    """What the server got: bytes, and seconds from the connection to its end."""
    n, took = srv.stdout.readline().split()
    srv.wait(timeout=10)
    return int(n), float(took)


def test_hosts_reach_each_other_and_nothing_else(hosts):
    h0, h1, h2 = hosts
    assert len({h.ip for h in hosts}) == 3 and all(h.ip.startswith("10.") for h in hosts)
    # one interface with one address and one route: the hosts' /24, no default route
    for h in hosts:
        addrs = json.loads(h.check_output(["ip", "-j", "-4", "addr"]))
        assert {(a["ifname"], i["local"]) for a in addrs for i in a["addr_info"]} == {("lo", "127.0.0.1"), ("eth0", h.ip)}
        routes = json.loads(h.check_output(["ip", "-j", "route"]))
        assert [r["dst"] for r in routes] == [hosts.subnet + ".0/24"]
    # a TCP stream h0 -> h1, counted on both interfaces (payload plus headers)
    tx0, rx0 = hosts.bytes("h0")
    tx1, rx1 = hosts.bytes("h1")
    srv = _serve(h1)
    _send(h0, h1, 1_000_000)
    assert _received(srv)[0] == 1_000_000
    sent, got = hosts.bytes("h0")[0] - tx0, hosts.bytes("h1")[1] - rx1
    assert 1_000_000 < sent < 1_100_000 and 1_000_000 < got < 1_100_000
    assert hosts.bytes("h2")[1] < 10_000  # h2 saw at most ARP broadcasts
    # the machine's own addresses are not reachable from a host
    outside = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    other = next(line.split()[3].split("/")[0] for line in outside.splitlines() if " lo " not in line)
    with pytest.raises(RuntimeError, match="unreachable"):
        h2.check_output([PY, "-c", f"import socket; socket.create_connection(('{other}', 22), timeout=2)"])


def test_rate_limit_and_partition(make_hosts):
    hosts = make_hosts(2, rate_mbit={"h1": 8})
    h0, h1 = hosts
    # 1 MB into a host limited to 8 Mbit/s (1 MB/s) takes about a second, whatever the load
    srv = _serve(h1)
    _send(h0, h1, 1_000_000)
    n, took = _received(srv)
    assert n == 1_000_000 and took > 0.8, f"1 MB crossed an 8 Mbit/s link in {took:.2f} s"
    h1.clear_rate()
    # partition: h1's port down, a connection to it times out; healed, it goes through
    srv = _serve(h1)
    h1.link_down()
    with pytest.raises(RuntimeError, match="timed out|unreachable"):
        _send(h0, h1, 10, timeout_s=1.0)
    assert srv.poll() is None  # h1 itself keeps running
    h1.link_up()
    _send(h0, h1, 1000)
    assert _received(srv)[0] == 1000


def test_kill_all_takes_daemons_too(hosts):
    h1 = hosts["h1"]
    direct = h1.run(["sleep", "300"])
    # a daemon: its own session, parent gone, not a child of this process
    h1.check_output(["sh", "-c", "setsid sleep 301 </dev/null >/dev/null 2>&1 &"])
    other = hosts["h2"].run(["sleep", "302"])
    deadline = time.monotonic() + 5
    while len(h1.pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(h1.pids()) == 2
    killed = h1.kill_all()
    assert direct.pid in killed and len(killed) == 2
    assert direct.returncode == -signal.SIGKILL and h1.pids() == []
    assert other.poll() is None  # another host is untouched


# -- nothing left behind ----------------------------------------------------------------------

BODY = """
import os, signal, subprocess, sys, time
sys.path.insert(0, {tests!r})
import hosts as H
hs = H.Hosts(2)
hs["h0"].run(["sleep", "300"])
hs["h1"].check_output(["sh", "-c", "setsid sleep 301 </dev/null >/dev/null 2>&1 &"])
while len(hs["h1"].pids()) < 1: time.sleep(0.01)
pids = [p for h in hs for p in h.pids()]
print(hs.prefix, " ".join(f"{{p}}:{{H._start_time(p)}}" for p in pids), flush=True)
how = {how!r}
if how == "exception":
    raise RuntimeError("the test body fails")
elif how == "exit":
    sys.exit(3)
time.sleep(60)  # killed by the test
"""

PYTEST_BODY = """
from hosts import hosts  # noqa: F401
import hosts as H, time

def test_fails(hosts):
    hosts["h0"].run(["sleep", "300"])
    hosts["h2"].check_output(["sh", "-c", "setsid sleep 301 </dev/null >/dev/null 2>&1 &"])
    while len(hosts["h2"].pids()) < 1: time.sleep(0.01)
    pids = [p for h in hosts for p in h.pids()]
    print("MARK", hosts.prefix, " ".join(f"{p}:{H._start_time(p)}" for p in pids), flush=True)
    assert False, "the test body fails"
"""


def _assert_nothing_left(prefix: str, pids: list[tuple[int, int]]) -> None:
    left = H.leftovers(prefix)
    assert left == {"namespaces": [], "links": [], "state_files": []}, left
    alive = [p for p, start in pids if H.alive(p, start)]
    assert alive == [], f"processes {alive} survived"


def _parse(line: str) -> tuple[str, list[tuple[int, int]]]:
    prefix, *pids = line.split()
    return prefix, [(int(a), int(b)) for a, b in (p.split(":") for p in pids)]


@pytest.mark.parametrize("how", ["exception", "exit", "SIGINT", "SIGTERM", "SIGKILL"])
def test_nothing_left_behind(how, tmp_path):
    H.skip_unless_available()
    p = subprocess.Popen([PY, "-c", BODY.format(tests=str(TESTS), how=how)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    prefix, pids = _parse(p.stdout.readline())
    assert prefix.startswith("vf") and len(pids) == 2
    assert H.leftovers(prefix)["namespaces"], "the hosts were built"
    if how.startswith("SIG"):
        p.send_signal(getattr(signal, how))
    p.wait(timeout=30)
    if how == "SIGKILL":  # nothing ran in the process: its watchdog tears down
        deadline = time.monotonic() + 10
        while H.leftovers(prefix)["namespaces"] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    else:
        assert p.returncode != 0
    _assert_nothing_left(prefix, pids)


def test_nothing_left_behind_a_failing_pytest_test(tmp_path):
    H.skip_unless_available()
    (tmp_path / "test_body.py").write_text(PYTEST_BODY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([PY, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        "-c", os.devnull, str(tmp_path / "test_body.py")],
                       capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and "the test body fails" in r.stdout, r.stdout + r.stderr
    mark = next(line for line in r.stdout.splitlines() if "MARK" in line)
    prefix, pids = _parse(mark.split("MARK", 1)[1])
    assert len(pids) == 2
    _assert_nothing_left(prefix, pids)


# -- virtualflow across hosts ----------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """The job's undisturbed deterministic run (the VN engine in this process: :mod:`vn_reference`)."""
    H.skip_unless_available()
    import jobs
    from vn_reference import deterministic_reference

    return deterministic_reference(jobs.make_job(), STEPS)


def _assert_matches(run_dir: Path, reference) -> None:
    from conftest import assert_state_equal, flat_optimizer_state
    from virtualflow.runtime.checkpoint import load_state

    state = load_state(str(run_dir / "final.pt"))
    assert state["step"] == STEPS
    assert_state_equal(state["model"], reference.state_dict)
    assert_state_equal(flat_optimizer_state(state["optimizer"]), flat_optimizer_state(reference.optimizer_state_dict))


def _log(tmp_path: Path, name: str):
    return open(tmp_path / f"{name}.log", "wb")


def _tail(tmp_path: Path, *names: str) -> str:
    return "\n".join(f"--- {n}:\n" + (tmp_path / f"{n}.log").read_text(errors="replace")[-3000:] for n in names)


@pytest.mark.slow
def test_external_workers_join_from_other_hosts(hosts, tmp_path, reference):
    h0, h1, h2 = hosts
    token = tmp_path / "token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    run_dir, addr = tmp_path / "run", f"{h0.ip}:29400"
    before = {h.name: hosts.bytes(h) for h in hosts}
    coord = h0.run([*VF, "run", JOB, "--backend", "external", "--listen", addr, "--workers", "2",
                    "--steps", str(STEPS), "--deterministic", "--run-dir", run_dir, "--token-file", token,
                    "--no-progress"], env=ENV, stdout=_log(tmp_path, "coordinator"), stderr=subprocess.STDOUT)
    # gloo's address three ways: the job's auto (h0's coordinator), a machine's GLOO_SOCKET_IFNAME
    # (h1), `virtualflow worker --interface ADDR` (h2)
    join = [*VF, "worker", "--join", addr, "--token-file", token, "--join-timeout", "60"]
    workers = [h1.run(join, env={**ENV, "GLOO_SOCKET_IFNAME": "eth0"}, stdout=_log(tmp_path, "h1"),
                      stderr=subprocess.STDOUT),
               h2.run([*join, "--interface", h2.ip], env=ENV, stdout=_log(tmp_path, "h2"), stderr=subprocess.STDOUT)]
    logs = ("coordinator", "h1", "h2")
    assert coord.wait(timeout=120) == 0, _tail(tmp_path, *logs)
    assert [w.wait(timeout=30) for w in workers] == [0, 0], _tail(tmp_path, *logs)
    assert f"collectives bind {h1.ip} (GLOO_SOCKET_IFNAME eth0)" in (tmp_path / "h1.log").read_text()
    assert f"collectives bind {h2.ip} (virtualflow worker --interface {h2.ip})" in (tmp_path / "h2.log").read_text()
    _assert_matches(run_dir, reference)
    joined = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sorted(e["worker"] for e in joined if e["event"] == "joined") == [0, 1]
    # worker-to-worker traffic (gloo) crossed the links: what h1 and h2 sent beyond what reached
    # h0 (the store's traffic) is at least one model's worth (385 float32 values) per step
    sent = {h.name: hosts.bytes(h)[0] - before[h.name][0] for h in (h1, h2)}
    to_h0 = hosts.bytes(h0)[1] - before["h0"][1]
    assert sent["h1"] + sent["h2"] - to_h0 > STEPS * 385 * 4, (sent, to_h0)


RAY_DRIVER = """
import json, sys
import virtualflow as vf
job, steps, address, run_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
handle = vf.launch(job, workers=2, steps=steps, deterministic=True, backend="ray", address=address,
                   run_dir=run_dir, progress=False,
                   worker_specs=[vf.WorkerSpec(resources={"h1": 1}), vf.WorkerSpec(resources={"h2": 1})])
handle.wait(timeout_s=240)
print(json.dumps({"store": handle.coordinator.host,
                  "nodes": {w: handle.backend.workers[w].node_ip for w in sorted(handle.backend.workers)}}))
"""


@pytest.mark.slow
@pytest.mark.ray
def test_ray_cluster_across_hosts(hosts, tmp_path, reference):
    """`ray start --head` in h0, `ray start --address` in h1 and h2; the driver in h0 places one
    worker on each of h1 and h2 and trains exactly as one local worker does."""
    pytest.importorskip("ray")
    ray_bin = Path(PY).with_name("ray")
    h0, h1, h2 = hosts
    (tmp_path / "ray-token").write_text(os.urandom(32).hex())
    temp = Path(f"/tmp/{hosts.prefix}ray")  # short: Ray's unix sockets live under it
    env = {**ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "ray-token"),
           "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--disable-usage-stats", "--object-store-memory", str(100 << 20)]
    try:
        h0.check_output([ray_bin, "start", "--head", "--node-ip-address", h0.ip, "--port", "6379", "--num-cpus", "0",
                         "--include-dashboard=false", "--temp-dir", temp, *common], env=env, timeout_s=120)
        for h in (h1, h2):  # one after the other: nodes sharing a temp dir pick their socket names racily
            h.check_output([ray_bin, "start", "--address", f"{h0.ip}:6379", "--node-ip-address", h.ip, "--num-cpus",
                            "1", "--resources", json.dumps({h.name: 1}), *common], env=env, timeout_s=120)
        out = h0.check_output([PY, "-c", RAY_DRIVER, JOB, str(STEPS), f"{h0.ip}:6379", tmp_path / "run"], env=env,
                              timeout_s=300)
    finally:
        hosts.close()  # Ray's daemons live in the hosts: gone before their directory is
        shutil.rmtree(temp, ignore_errors=True)
    placed = json.loads(out.strip().splitlines()[-1])
    assert placed == {"store": h0.ip, "nodes": {"0": h1.ip, "1": h2.ip}}
    _assert_matches(tmp_path / "run", reference)
