"""The network knobs: what gloo binds to (``interface``), where the store listens (``listen``),
and the errors that name the value, the rule and the knob when an address cannot work.

In-process, on this machine's own interfaces; tests/e2e/test_hosts.py runs them across hosts.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

import virtualflow as vf
from virtualflow.backends.local_worker import interface_from_environment
from virtualflow.backends.ray import unreachable_store
from virtualflow.comm import net
from virtualflow.config.job import JobSource
from virtualflow.config.network import parse_listen
from virtualflow.config.options import LaunchOptions
from virtualflow.runtime.worker import run_worker
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.worker_config import WorkerConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _absent_interface() -> str:
    names = set(net.interfaces())
    return next(f"vfnone{i}" for i in range(100) if f"vfnone{i}" not in names)


def test_auto_binds_the_address_that_reaches_the_store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert net.resolve_interface("auto", "127.0.0.1", store.port) == ["127.0.0.1"]
    assert net.resolve_interface("lo", "127.0.0.1", store.port) == ["127.0.0.1"]
    assert net.resolve_interface("127.0.0.1,lo", "127.0.0.1", store.port) == ["127.0.0.1", "127.0.0.1"]


def test_an_interface_or_address_this_machine_lacks_is_named_with_the_knob():
    missing = _absent_interface()
    with pytest.raises(ValueError, match=rf"GLOO_SOCKET_IFNAME '{missing}': this machine .* has no interface "
                                         rf"'{missing}'; its interfaces: .*lo"):
        net.resolve_interface(missing, "127.0.0.1", 1, knob="GLOO_SOCKET_IFNAME")
    with pytest.raises(ValueError, match=r"--interface '192.0.2.77': 192.0.2.77 is not an address of this machine"):
        net.resolve_interface("192.0.2.77", "127.0.0.1", 1)  # TEST-NET-1: nobody's


@pytest.mark.parametrize("bad", ["", "eth 0", "a" * 16, "eth0,", "eth0/1"])
def test_interface_syntax_is_checked_at_launch(bad):
    with pytest.raises(ValueError, match=r"interface= \(--interface\)"):
        LaunchOptions(steps=1, interface=bad)


def test_listen_rules_per_backend():
    assert LaunchOptions(steps=1, backend="external", listen="0.0.0.0:29400").listen == "0.0.0.0:29400"
    assert LaunchOptions(steps=1, backend="ray", listen="10.0.0.5").listen == "10.0.0.5"
    with pytest.raises(ValueError, match="only applies to backend='external' or 'ray'"):
        LaunchOptions(steps=1, listen="10.0.0.5:29400")
    with pytest.raises(ValueError, match="on Ray the workers are told the store's address"):
        LaunchOptions(steps=1, backend="ray", listen="0.0.0.0:29400")
    with pytest.raises(ValueError, match=r"listen= \(--listen\) '10.0.0.5' is not ADDR:PORT"):
        LaunchOptions(steps=1, backend="external", listen="10.0.0.5")
    assert parse_listen("10.0.0.5", port_optional=True) == ("10.0.0.5", 0)
    assert parse_listen("[::1]:29400") == ("::1", 29400)
    assert parse_listen("::1", port_optional=True) == ("::1", 0)


def test_a_store_address_that_is_not_this_machines_fails_the_launch():
    with pytest.raises(ValueError, match=r"cannot listen on 192.0.2.77:29400: 192.0.2.77 is not an address of this "
                                         r"machine .*listen= \(--listen\)"):
        vf.launch("jobs:make_job", workers=1, steps=1, backend="external", listen="192.0.2.77:29400")


def test_a_store_on_loopback_is_refused_when_ray_nodes_are_elsewhere():
    why = unreachable_store("127.0.0.1", ["127.0.0.1", "10.0.0.6", "10.0.0.7"], given=False)
    assert "127.0.0.1, Ray's address for this node," in why and "10.0.0.6, 10.0.0.7 cannot reach" in why
    assert "--listen ADDR" in why and "--node-ip-address" in why
    assert "listen='127.0.0.1' (--listen)" in unreachable_store("127.0.0.1", ["10.0.0.6"], given=True)
    assert unreachable_store("127.0.0.1", ["127.0.0.1"], given=False) is None  # a one-machine cluster
    assert unreachable_store("10.0.0.5", ["10.0.0.5", "10.0.0.6"], given=False) is None


def _config(**kw) -> WorkerConfig:
    base = dict(store_host="127.0.0.1", store_port=1, job_source=JobSource(kind="spec", target="jobs:make_job"), total_steps=1,
                state_dir="/nonexistent", overrides={}, threads=1, resume_path=None, initial_workers=1,
                options=WorkerOptions(deterministic=True, device="cpu", collective_timeout_s=5.0),
                slowdowns={}, job_id="0123456789abcdef", run_key="k" * 64)
    return WorkerConfig(**{**base, **kw})


def test_gloo_socket_ifname_applies_where_the_job_left_auto():
    cfg = interface_from_environment(_config(), {"GLOO_SOCKET_IFNAME": "eth1"})
    assert (cfg.interface, cfg.interface_knob) == ("eth1", "GLOO_SOCKET_IFNAME")
    cfg = interface_from_environment(_config(interface="eth0"), {"GLOO_SOCKET_IFNAME": "eth1"})
    assert (cfg.interface, cfg.interface_knob) == ("eth0", "--interface")  # the job's explicit choice wins
    assert interface_from_environment(_config(), {}).interface == "auto"
    assert _config().gloo_bind() is None and _config(interface="10.0.0.5,10.0.1.5").gloo_bind() == ["10.0.0.5", "10.0.1.5"]


def test_a_worker_that_cannot_reach_the_store_says_where_it_looked():
    port = _free_port()  # nothing listens there
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:  # run_worker sets the process's torch settings, as a worker process should: put them back
        with pytest.raises(ConnectionError, match=rf"worker 3 \(.*\) cannot reach the job's store at 127.0.0.1:{port}: "
                                                  r".*listen= / --listen"):
            run_worker(_config(store_port=port, store_timeout_s=0.5), 3)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
