"""Hosts on one machine: Linux network namespaces joined by a private bridge.

Each host is a network namespace with one interface, ``eth0``, a veth whose other end is a port
of a bridge that exists only for this run. Hosts get addresses ``10.X.Y.2``, ``10.X.Y.3``, ...
of one /24 chosen at random; the bridge has no address and the namespaces have no default
route, so a process in a host can reach the other hosts' addresses and its own loopback and
nothing else (IPv6 is disabled in them, so no router solicitations or multicast leave either).

    with Hosts(n=3, rate_mbit={"h1": 100}) as hosts:
        hosts["h0"].ip                        # "10.X.Y.2"
        p = hosts["h0"].run([...], env=...)   # a subprocess.Popen started inside the namespace
        hosts["h1"].check_output([...])       # its stdout (str); raises with its stderr
        hosts["h1"].link_down()               # a partition: the host's switch port goes down
        hosts["h1"].link_up()                 # healed
        hosts["h1"].set_rate(10)              # tbf, both directions, in Mbit/s
        hosts["h1"].clear_rate()
        hosts["h1"].kill_all()                # every process in the namespace, at once
        hosts.bytes("h1")                     # (tx, rx) bytes of the host's interface

Invariants:

- Every name this harness creates (namespaces ``vfXXXX-h0``, veths ``vfXXXXh0``, the bridge
  ``vfXXXXbr``) carries a per-run prefix ``vf`` + 4 hex digits, so concurrent runs on one machine
  never touch each other's hosts, and interface names stay within Linux's 15 characters.
- Before anything is created, the names are written to a state file under
  ``/tmp/virtualflow-hosts/``; teardown works from that file and is idempotent.
- Teardown (on leaving the ``with``, on an exception, on SIGINT and SIGTERM, via ``atexit``)
  kills every process in each namespace (``ip netns pids``, also daemons that left the
  process group), reaps the ones this process started, deletes the namespaces, the veths and
  the bridge. A watchdog process tears down when the process that built the hosts dies even by
  SIGKILL, and any later ``Hosts`` sweeps state files whose owner is gone.
- Only stdlib: the watchdog and ``scripts/hosts.sh`` run this file directly.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

log = logging.getLogger(__name__)

STATE_DIR = Path("/tmp/virtualflow-hosts")
IFNAME = "eth0"  # the host's interface inside its namespace
_PREFIX_LEN = 6  # "vf" + 4 hex digits
_MAX_NAME = 15 - _PREFIX_LEN  # a host name must leave the veth name within IFNAMSIZ - 1


# ----------------------------------------------------------------------------------------------
# Commands


def _cmd(args: Sequence[str], *, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


def _quiet(args: Sequence[str]) -> None:
    """Run a teardown command; it may find nothing left to remove."""
    try:
        subprocess.run(list(args), capture_output=True, timeout=30.0)
    except (OSError, subprocess.TimeoutExpired) as e:  # pragma: no cover - best effort
        log.warning("hosts teardown: %s: %s", " ".join(args), e)


_AVAILABLE: str | None | bool = False  # False: not probed yet; None: available; str: why not


def unavailable_reason() -> str | None:
    """Why hosts cannot be built on this machine (None when they can). Probed once."""
    global _AVAILABLE
    if _AVAILABLE is not False:
        return _AVAILABLE  # type: ignore[return-value]
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = f"network namespaces are Linux only (this is {sys.platform})"
    elif os.geteuid() != 0:
        reason = "needs root (network namespaces, veths, bridges)"
    elif shutil.which("ip") is None:
        reason = "needs iproute2's `ip` on PATH"
    elif shutil.which("tc") is None:
        reason = "needs iproute2's `tc` on PATH (tbf rate limits)"
    else:
        probe = f"vfprobe{os.getpid() % 100000}"
        r = _cmd(["ip", "netns", "add", probe], check=False)
        if r.returncode != 0:
            reason = f"`ip netns add` fails here: {r.stderr.strip()}"
        else:
            _quiet(["ip", "netns", "del", probe])
    _AVAILABLE = reason
    return reason


def skip_unless_available() -> None:
    """pytest.skip with one line when hosts cannot be built (no root, no `ip`)."""
    reason = unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(f"hosts (network namespaces): {reason}")


# ----------------------------------------------------------------------------------------------
# Processes and namespaces


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int, start: int | None) -> bool:
    """Whether the process ``pid`` that started at ``start`` (``_start_time``) still runs
    (a zombie has ended; only its parent has yet to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] not in ("Z", "X") and int(fields[19]) == start


def ns_pids(ns: str) -> list[int]:
    """Pids of the live processes in namespace ``ns`` (zombies have left it)."""
    r = _cmd(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()] if r.returncode == 0 else []


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_namespace(ns: str, *, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process in ``ns`` at once and wait until none is left; returns their pids.

    Processes are first stopped (SIGSTOP) until no new one appears, so that none can fork or
    react while the others die, then all are killed together.
    """
    stopped: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fresh = [p for p in ns_pids(ns) if p not in stopped]
        if not fresh:
            break
        _signal(fresh, signal.SIGSTOP)
        stopped.update(fresh)
    _signal(sorted(stopped), signal.SIGKILL)
    while time.monotonic() < deadline:
        left = ns_pids(ns)
        if not left:
            return sorted(stopped)
        _signal(left, signal.SIGKILL)
        stopped.update(left)
        time.sleep(0.02)
    raise RuntimeError(f"processes {ns_pids(ns)} still in namespace {ns} after SIGKILL for {timeout_s} s")


def teardown_state(state: Mapping) -> list[str]:
    """Remove everything a state file names: processes, namespaces, veths, bridge. Idempotent;
    returns the errors met (also logged) instead of stopping at the first."""
    errors: list[str] = []
    for ns in state.get("namespaces", []):
        try:
            kill_namespace(ns)
        except Exception as e:  # noqa: BLE001 - teardown goes on
            errors.append(str(e))
        _quiet(["ip", "netns", "del", ns])
    for dev in [*state.get("veths", []), state.get("bridge")]:
        if dev and Path(f"/sys/class/net/{dev}").exists():
            _quiet(["ip", "link", "del", dev])
    path = state.get("path")
    if path:
        Path(path).unlink(missing_ok=True)
    for e in errors:
        log.warning("hosts teardown: %s", e)
    return errors


def leftovers(prefix: str = "vf") -> dict[str, list]:
    """Namespaces, links and state files whose names start with ``prefix`` (for tests that
    prove nothing is left behind)."""
    r = _cmd(["ip", "netns", "list"], check=False)
    namespaces = [line.split()[0] for line in r.stdout.splitlines() if line.startswith(prefix)]
    namespaces = [ns for ns in namespaces if not ns.startswith("vfprobe")]
    links = [p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(prefix)]
    files = sorted(p.name for p in STATE_DIR.glob(f"{prefix}*.json")) if STATE_DIR.exists() else []
    return {"namespaces": namespaces, "links": links, "state_files": files}


def sweep_stale() -> list[str]:
    """Tear down the hosts of runs whose owning process is gone (killed before it could)."""
    swept = []
    for path in STATE_DIR.glob("vf*.json") if STATE_DIR.exists() else []:
        try:
            state = json.loads(path.read_text())
            owner, started = int(state["owner_pid"]), state["owner_start"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours
        if _start_time(owner) != started:
            teardown_state({**state, "path": str(path)})
            swept.append(state.get("prefix", path.stem))
    return swept


# ----------------------------------------------------------------------------------------------
# One host


class Host:
    """One namespace: its name, address and interface, and what runs in it."""

    def __init__(self, hosts: Hosts, name: str, ip: str, index: int):
        self._hosts = hosts
        self.name = name
        self.index = index
        self.ip = ip
        self.ns = f"{hosts.prefix}-{name}"
        self.ifname = IFNAME
        self.veth = f"{hosts.prefix}{name}"  # the bridge port (root namespace) of this host's link
        self.procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Host({self.name}, ip={self.ip}, ns={self.ns})"

    def _argv(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *map(str, cmd)]

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**os.environ, **(env or {})}

    def run(self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, **popen_kw) -> subprocess.Popen:
        """Start ``cmd`` in this host (``env`` is added to this process's environment). The
        process is killed and reaped at teardown if still alive."""
        p = subprocess.Popen(self._argv(cmd), env=self._env(env), **popen_kw)
        self.procs.append(p)
        return p

    def check_output(self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
                     timeout_s: float = 60.0, input: str | None = None) -> str:
        """Run ``cmd`` in this host to completion; its stdout, or an error with its stderr."""
        r = subprocess.run(self._argv(cmd), env=self._env(env), capture_output=True, text=True,
                           timeout=timeout_s, input=input)
        if r.returncode != 0:
            raise RuntimeError(f"{self.name}: `{' '.join(map(str, cmd))}` exited {r.returncode}:\n{r.stderr}")
        return r.stdout

    def pids(self) -> list[int]:
        """The processes alive in this host."""
        return ns_pids(self.ns)

    def kill_all(self) -> list[int]:
        """The host dies: SIGKILL every process in it at once; returns their pids."""
        killed = kill_namespace(self.ns)
        for p in self.procs:
            if p.poll() is None and p.pid in killed:
                p.wait(timeout=10)
        return killed

    def link_down(self) -> None:
        """A partition: this host's switch port goes down. Its packets are dropped silently
        (open connections retransmit, new ones time out), its processes keep running."""
        _cmd(["ip", "link", "set", self.veth, "down"])

    def link_up(self) -> None:
        """The partition heals."""
        _cmd(["ip", "link", "set", self.veth, "up"])

    def set_rate(self, mbit: float) -> None:
        """Limit this host's link to ``mbit`` Mbit/s in each direction (tbf on both veth ends)."""
        if not mbit > 0:
            raise ValueError(f"rate mbit={mbit!r} must be > 0 (clear_rate() removes the limit)")
        rate_bytes = mbit * 1e6 / 8
        burst = max(32 * 1024, int(rate_bytes / 250))  # 4 ms of traffic, at least 32 KiB
        limit = int(rate_bytes * 0.1) + burst  # up to ~100 ms queued, then drops
        tbf = ["root", "tbf", "rate", f"{int(mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]
        _cmd(["tc", "-n", self.ns, "qdisc", "replace", "dev", self.ifname, *tbf])  # what it sends
        _cmd(["tc", "qdisc", "replace", "dev", self.veth, *tbf])  # what it receives

    def clear_rate(self) -> None:
        _cmd(["tc", "-n", self.ns, "qdisc", "del", "dev", self.ifname, "root"], check=False)
        _cmd(["tc", "qdisc", "del", "dev", self.veth, "root"], check=False)

    def bytes(self) -> tuple[int, int]:
        """(tx, rx): bytes this host's interface sent and received, from its link's counters
        (the bridge port's rx is the host's tx)."""
        stats = Path(f"/sys/class/net/{self.veth}/statistics")
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


# ----------------------------------------------------------------------------------------------
# The set of hosts


_OPEN: list[Hosts] = []
_HANDLERS_INSTALLED = False


def _close_all() -> None:
    for h in list(_OPEN):
        h.close()


def _on_signal(signum, frame) -> None:
    for h in list(_OPEN):
        h.close(force=True)  # complete even a close this signal interrupted
    previous = _PREVIOUS.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_PREVIOUS: dict[int, object] = {}


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    atexit.register(_close_all)
    _HANDLERS_INSTALLED = True
    if threading.current_thread() is threading.main_thread():  # else: atexit and the watchdog
        for sig in (signal.SIGINT, signal.SIGTERM):
            _PREVIOUS[sig] = signal.getsignal(sig)
            signal.signal(sig, _on_signal)


def _pick_subnet() -> str:
    """A random 10.X.Y.0/24 that no interface of this machine uses (the hosts are isolated from
    it anyway; this keeps addresses in logs unambiguous)."""
    used = _cmd(["ip", "-o", "-4", "addr"], check=False).stdout
    rng = random.Random(secrets.randbits(64))
    for _ in range(100):
        subnet = f"10.{rng.randint(64, 250)}.{rng.randint(1, 254)}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError("no free 10.X.Y.0/24 subnet found")


class Hosts:
    """``n`` hosts named ``h0``.. (or ``names``) on a private bridge; see the module docstring.

    ``rate_mbit``: a limit for every host (a number) or per host name (a dict), as ``set_rate``.
    """

    def __init__(self, n: int = 3, *, names: Sequence[str] | None = None,
                 rate_mbit: float | Mapping[str, float] | None = None):
        names = list(names) if names is not None else [f"h{i}" for i in range(n)]
        if not 1 <= len(names) <= 200:
            raise ValueError(f"n={len(names)} hosts: between 1 and 200")
        for name in names:
            if not re.fullmatch(rf"[a-z0-9]{{1,{_MAX_NAME}}}", name):
                raise ValueError(f"host name {name!r}: lowercase letters and digits, at most {_MAX_NAME} characters")
        if len(set(names)) != len(names):
            raise ValueError(f"host names {names} repeat")
        rates = dict(rate_mbit) if isinstance(rate_mbit, Mapping) else {nm: rate_mbit for nm in names} if rate_mbit else {}
        unknown = set(rates) - set(names)
        if unknown:
            raise ValueError(f"rate_mbit names hosts {sorted(unknown)} that are not among {names}")
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"hosts (network namespaces) unavailable: {reason}")

        sweep_stale()
        existing = _cmd(["ip", "netns", "list"]).stdout + " ".join(os.listdir("/sys/class/net"))
        while True:
            self.prefix = f"vf{secrets.token_hex(2)}"
            if self.prefix not in existing and not (STATE_DIR / f"{self.prefix}.json").exists():
                break
        self.subnet = _pick_subnet()
        self.bridge = f"{self.prefix}br"
        self._hosts = {nm: Host(self, nm, f"{self.subnet}.{i + 2}", i) for i, nm in enumerate(names)}
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_path = STATE_DIR / f"{self.prefix}.json"
        self._state = {
            "prefix": self.prefix, "owner_pid": os.getpid(), "owner_start": _start_time(os.getpid()),
            "bridge": self.bridge, "namespaces": [h.ns for h in self], "veths": [h.veth for h in self],
            "path": str(self._state_path),
        }
        self._state_path.write_text(json.dumps(self._state))  # names first: teardown finds all
        self._closed = False
        self._watchdog: subprocess.Popen | None = None
        _install_handlers()
        _OPEN.append(self)
        try:
            self._build()
            for nm, mbit in rates.items():
                if mbit:
                    self[nm].set_rate(mbit)
            self._watchdog = subprocess.Popen(
                [sys.executable, "-S", __file__, "watch", str(self._state_path), str(os.getpid())],
                start_new_session=True, stdin=subprocess.DEVNULL)
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _cmd(["ip", "link", "add", self.bridge, "type", "bridge", "stp_state", "0",
              "nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0"])
        _sysctl_root(self.bridge)
        _cmd(["ip", "link", "set", self.bridge, "up"])
        for h in self:
            _cmd(["ip", "netns", "add", h.ns])
            _cmd(["ip", "netns", "exec", h.ns, "sh", "-c",
                  "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 && "
                  "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"])
            _cmd(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", IFNAME, "netns", h.ns])
            _sysctl_root(h.veth)
            _cmd(["ip", "link", "set", h.veth, "master", self.bridge, "up"])
            _cmd(["ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", IFNAME])
            _cmd(["ip", "-n", h.ns, "link", "set", IFNAME, "up"])
            _cmd(["ip", "-n", h.ns, "link", "set", "lo", "up"])

    # -- access
    def __getitem__(self, key: str | int) -> Host:
        if isinstance(key, int):
            return list(self._hosts.values())[key]
        return self._hosts[key]

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts.values())

    def __len__(self) -> int:
        return len(self._hosts)

    @property
    def names(self) -> list[str]:
        return list(self._hosts)

    def bytes(self, host: str | Host) -> tuple[int, int]:
        """(tx, rx) bytes of ``host``'s interface."""
        return (host if isinstance(host, Host) else self[host]).bytes()

    def __repr__(self) -> str:
        return f"Hosts({', '.join(f'{h.name}={h.ip}' for h in self)}, prefix={self.prefix})"

    # -- teardown
    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, *, force: bool = False) -> list[str]:
        """Kill every process in every host, reap those started here, delete namespaces, veths
        and bridge. Idempotent; ``force`` runs it again even if a close is under way."""
        if self._closed and not force:
            return []
        self._closed = True
        if self._watchdog is not None and self._watchdog.poll() is None:
            self._watchdog.kill()
            self._watchdog.wait()
        errors = teardown_state(self._state)
        for h in self:
            for p in h.procs:
                if p.poll() is None:
                    p.kill()  # still in `ip netns exec`, or its namespace was already gone
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    errors.append(f"process {p.pid} of {h.name} did not exit after SIGKILL")
        if self in _OPEN:
            _OPEN.remove(self)
        return errors


def _sysctl_root(dev: str) -> None:
    """No IPv6 on the root-namespace ends either: nothing but our own IPv4 crosses them."""
    p = Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6")
    if p.exists():
        p.write_text("1")


# ----------------------------------------------------------------------------------------------
# pytest fixtures (import them into a test module: `from hosts import hosts, make_hosts`)

try:
    import pytest
except ImportError:  # the watchdog and scripts/hosts.sh run without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    def _factory():
        skip_unless_available()
        made: list[Hosts] = []

        def make(n: int = 3, **kw) -> Hosts:
            h = Hosts(n, **kw)
            made.append(h)
            return h

        try:
            yield make
        finally:
            for h in made:
                h.close()

    @pytest.fixture
    def make_hosts():
        """A factory ``make_hosts(n=3, rate_mbit=..., names=...) -> Hosts``; every set it made is
        torn down after the test, whatever its outcome. Skips without root or `ip`."""
        yield from _factory()

    @pytest.fixture
    def hosts():
        """Three hosts h0, h1, h2 (``make_hosts`` for other shapes); torn down after the test."""
        for make in _factory():
            yield make(3)


# ----------------------------------------------------------------------------------------------
# Command line: the watchdog, and scripts/hosts.sh


def _watch(state_path: str, owner: int) -> None:
    """Tear down when ``owner`` (our parent) is gone, however it died."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == owner:
        time.sleep(0.2)
    try:
        state = json.loads(Path(state_path).read_text())
    except (OSError, ValueError):
        return  # torn down already
    teardown_state(state)


def _interactive(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="scripts/hosts.sh up")
    ap.add_argument("-n", type=int, default=3, help="number of hosts (h0, h1, ...)")
    ap.add_argument("--rate", action="append", default=[], metavar="HOST=MBIT",
                    help="limit a host's link, e.g. --rate h1=100 (repeatable)")
    args = ap.parse_args(argv)
    rates = {}
    for item in args.rate:
        name, _, mbit = item.partition("=")
        rates[name] = float(mbit)
    with Hosts(args.n, rate_mbit=rates or None) as hosts:
        for h in hosts:
            rate = f"  {rates[h.name]:g} Mbit/s" if h.name in rates else ""
            print(f"{h.name}  {h.ip:<15} ip netns exec {h.ns} bash{rate}")
        print(f"bridge {hosts.bridge}; Ctrl-C or Enter tears everything down", flush=True)
        try:
            sys.stdin.readline()
        except KeyboardInterrupt:
            pass


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    verb = argv[0] if argv else "help"
    if verb == "watch":
        _watch(argv[1], int(argv[2]))
    elif verb == "up":
        _interactive(argv[1:])
    elif verb == "clean":
        swept = sweep_stale()
        print(f"swept {len(swept)} abandoned run(s) {swept}; left: {leftovers()}")
    elif verb == "list":
        print(json.dumps(leftovers(), indent=1))
    else:
        print("usage: hosts.py up [-n N] [--rate HOST=MBIT] | clean | list", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
