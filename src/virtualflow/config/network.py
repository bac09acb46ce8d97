"""The network knobs' text forms, checked where they are given (options, flags): what the
workers' collectives bind to (``interface``) and where the coordinator's store listens
(``listen``). Whether an interface or address exists is known only on the machine concerned:
:mod:`virtualflow.comm.net` resolves them there.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["check_interface_spec", "is_ip", "parse_listen"]

_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")


def is_ip(text: str) -> bool:
    """Whether ``text`` is an IPv4 or IPv6 address literal."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def check_interface_spec(spec: object, knob: str = "--interface") -> None:
    """Raise ``ValueError`` unless ``spec`` reads as ``auto``, or comma-separated interface names
    and addresses."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{knob} {spec!r} must be 'auto', an interface name such as eth0, or an address of the "
                         f"worker's machine")
    if spec == "auto":
        return
    for part in spec.split(","):
        if not (is_ip(part) or _IFNAME.fullmatch(part)):
            raise ValueError(f"{knob} {spec!r}: {part!r} is neither an interface name (at most 15 letters, digits "
                             f"or _.:@-) nor an IP address; give 'auto', e.g. eth0, or e.g. 10.0.0.5")


def parse_listen(text: str, what: str = "--listen", *, port_optional: bool = False) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[v6]:PORT"`` for IPv6; with ``port_optional`` also a bare host, port 0:
    any free one) -> (host, port)."""
    text = str(text)
    if port_optional and (is_ip(text.strip("[]")) or ":" not in text):
        host, port = text.strip("[]"), "0"
    else:
        host, sep, port = text.rpartition(":")
        host = host.strip("[]")
        if not sep:
            host = ""
    if not host or not port.isdigit() or not 0 <= int(port) < 65536 or (int(port) == 0 and not port_optional):
        example = "10.0.0.5 or 10.0.0.5:29400" if port_optional else "10.0.0.5:29400, or 0.0.0.0:29400 for every interface"
        raise ValueError(f"{what} {text!r} is not {'ADDR[:PORT]' if port_optional else 'ADDR:PORT'} (e.g. {example})")
    return host, int(port)
