"""Every socket a real engine listens on is on loopback (docs/security.md, "Engine sockets").

Read from /proc, whoever in the engine opened it: the HTTP server, the scheduler's ZMQ ports, torch's
TCPStore (which binds every interface unless the gateway's SGLang plugin binds it), gloo, NCCL.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from launch.engine_net import SOCKET_IFNAME_ENVS, interface_addresses
from launch.proc_sockets import group_listening_sockets
from launch.process import EngineProcess


def test_every_listening_socket_of_the_engine_is_on_loopback(tiny_engine: EngineProcess) -> None:
    assert tiny_engine.pid is not None and tiny_engine.config.host == "127.0.0.1"
    found = group_listening_sockets(tiny_engine.pid)
    print(f"listening sockets of engine {tiny_engine.name} (process group {tiny_engine.pid}):")
    for sock in found:
        print(f"  {'WILDCARD' if sock.wildcard else 'loopback' if sock.loopback else 'OTHER   '} {sock}")
    assert tiny_engine.port in {sock.port for sock in found}  # the listing sees the HTTP server...
    assert any(sock.pid != tiny_engine.pid for sock in found)  # ...and the scheduler's sockets (TCPStore, gloo)
    wildcard = [str(sock) for sock in found if sock.wildcard]
    assert not wildcard, f"engine sockets bound to every interface: {wildcard}"
    off_loopback = [str(sock) for sock in found if not sock.loopback]
    assert not off_loopback, f"engine sockets off loopback: {off_loopback}"


def test_the_engine_gets_loopback_interfaces_for_gloo_and_nccl(tiny_engine: EngineProcess) -> None:
    """Read from the server process its scheduler inherits them from (the scheduler's retitling overwrites its
    own ``/proc/PID/environ``)."""
    assert tiny_engine.pid is not None
    environ = Path(f"/proc/{tiny_engine.pid}/environ").read_bytes().decode(errors="replace").split("\0")
    chosen = dict(entry.split("=", 1) for entry in environ if entry.split("=", 1)[0] in SOCKET_IFNAME_ENVS)
    assert chosen == dict.fromkeys(SOCKET_IFNAME_ENVS, "lo")  # only these: the rest may hold secrets


def test_the_engines_ports_refuse_connections_to_this_machines_other_addresses(tiny_engine: EngineProcess) -> None:
    """What another machine would see: nothing answers on the LAN address (the old TCPStore did)."""
    assert tiny_engine.pid is not None
    outside = [
        address
        for addresses in interface_addresses().values()
        for address in addresses
        if not address.is_loopback and not address.is_link_local
    ]
    if not outside:
        pytest.skip("this machine has no address but loopback")
    answered = []
    for sock in group_listening_sockets(tiny_engine.pid):
        for address in outside:
            family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.settimeout(2.0)
                if probe.connect_ex((str(address), sock.port)) == 0:
                    answered.append(f"{address} port {sock.port} ({sock})")
    assert not answered, answered
