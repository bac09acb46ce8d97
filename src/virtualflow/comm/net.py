"""Which network address a worker's collectives use, and whether an address is this machine's.

gloo, left alone, binds to the address its host's *name* resolves to. On many machines that is
loopback (``/etc/hosts`` maps the name to 127.0.x.1) or the wrong one of several interfaces: the
worker then tells its peers an address they cannot reach, and the first collective hangs until
its timeout. So every worker resolves :attr:`WorkerConfig.interface
<virtualflow.runtime.worker_config.WorkerConfig.interface>` once, to concrete addresses of its own
machine, before it builds a group, and gloo is given those (:func:`virtualflow.comm.groups.
make_group`'s ``bind``):

- ``"auto"`` (the default): the address this machine uses to reach the coordinator's store
  (the source address of its route there; a UDP ``connect`` sends nothing). The coordinator
  is reachable from every worker, so this interface is the one the workers share; a local job
  (store on 127.0.0.1) stays on loopback.
- an interface name (``"eth0"``; several: ``"eth0,eth1"``): its IPv4 address.
- an address (``"10.0.0.5"``): that address, which must be one of this machine's.

A value that cannot be resolved is a :class:`ValueError` naming the value, where it came from
(``--interface`` or ``GLOO_SOCKET_IFNAME``), the rule and this machine's interfaces. The
environment is read by the workers' entry points (``backends/``, ``cli/``), not here.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from typing import Any

from virtualflow.config.network import check_interface_spec, is_ip

__all__ = ["check_interface_spec", "interface_address", "interfaces", "is_local_address", "loopback_store",
           "resolve_interface", "route_source"]


def interfaces() -> list[str]:
    """This machine's network interface names."""
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except OSError:  # pragma: no cover - no interfaces to list
        return []


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name``, None when it has none; raises ``KeyError`` when
    this machine has no such interface. Linux (``SIOCGIFADDR``); elsewhere None (gloo resolves
    the name itself)."""
    if name not in interfaces():
        raise KeyError(name)
    if not sys.platform.startswith("linux"):
        return None
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV):
                return None
            raise
    return socket.inet_ntoa(res[20:24])


def is_local_address(address: str) -> bool:
    """Whether ``address`` belongs to this machine (something can listen on it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def route_source(host: str, port: int) -> str:
    """The address of this machine that packets to ``host:port`` leave from (no packet is sent)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def resolve_interface(spec: str, store_host: str, store_port: int, *, knob: str = "--interface") -> list[str]:
    """``spec`` (see the module docstring) as addresses of this machine for gloo to bind to.

    ``knob`` names where ``spec`` came from, for the error message."""
    check_interface_spec(spec, knob)
    here = socket.gethostname()
    if spec == "auto":
        try:
            return [route_source(store_host, store_port)]
        except OSError as exc:
            raise ValueError(f"{knob} auto: this machine ({here}) has no route to the coordinator's store at "
                             f"{store_host}:{store_port} ({exc.strerror or exc}); give the interface to use "
                             f"({knob} NAME or ADDRESS; interfaces here: {', '.join(interfaces())})") from None
    out = []
    for part in spec.split(","):
        if is_ip(part):
            if not is_local_address(part):
                raise ValueError(f"{knob} {spec!r}: {part} is not an address of this machine ({here}); name one "
                                 f"of its interfaces ({', '.join(interfaces())}), one of their addresses, or auto")
            out.append(part)
            continue
        try:
            addr = interface_address(part)
        except KeyError:
            raise ValueError(f"{knob} {spec!r}: this machine ({here}) has no interface {part!r}; its interfaces: "
                             f"{', '.join(interfaces())} (or give an address, or auto)") from None
        if addr is None and sys.platform.startswith("linux"):
            raise ValueError(f"{knob} {spec!r}: interface {part} of this machine ({here}) has no IPv4 address; "
                             f"name another ({', '.join(interfaces())}) or give an address")
        out.append(addr if addr is not None else part)
    return out


def loopback_store(store: Any) -> bool:
    """Whether ``store`` (a ``TCPStore``, possibly under ``PrefixStore``s) is reached over loopback:
    this process then shares the store's machine and network stack. Any other store: False."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    host = store.host if isinstance(store, dist.TCPStore) else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
