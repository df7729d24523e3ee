"""Where an engine's own sockets listen: loopback on one machine, the interface that reaches ``dist_init_addr``
for an engine spanning machines (``nnodes > 1``).

What binds what (SGLang 0.5.23, torch 2.14): the HTTP server binds ``--host``; the scheduler's ZMQ sockets
are ``ipc://`` on one machine and ``tcp://`` on ``dist_init_addr``'s host across machines; torch's rank-0
``TCPStore`` binds every interface whatever the address (fixed by the SGLang plugin in ``engine_plugin/``,
put on the engine's ``PYTHONPATH`` here); gloo's sockets bind ``GLOO_SOCKET_IFNAME`` (default: the
address the machine's hostname resolves to, often the LAN one); NCCL's bootstrap and socket transport bind
``NCCL_SOCKET_IFNAME`` (default: the first interface that is not loopback or docker). Neither of the two
last has authentication either, so on one machine both are set to loopback.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

from loguru import logger

from launch.config import EngineConfig

ENGINE_PLUGIN_DIR = Path(__file__).resolve().parent / "engine_plugin"
ENGINE_PLUGIN_NAME = "sglang_gateway_loopback_store"  # its entry point in engine_plugin/*.dist-info
PLUGINS_ENV = "SGLANG_PLUGINS"  # SGLang's allow-list of plugin names (all when unset)
SOCKET_IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK_INTERFACE = "lo"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
InterfaceFinder = Callable[[str], str | None]


def socket_env(
    engine: EngineConfig, env: Mapping[str, str], *, find_interface: InterfaceFinder | None = None
) -> dict[str, str]:
    """The variables to set in the engine's environment ``env`` (the inherited one with ``engine.env`` applied).

    On one machine gloo and NCCL go to loopback unless ``engine.env`` names an interface (an inherited value,
    often a cluster-wide default, does not count). Across machines they go to the interface that reaches
    ``dist_init_addr``, unless the environment already names one.
    """
    path = [str(ENGINE_PLUGIN_DIR), *(part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part)]
    out: dict[str, str] = {"PYTHONPATH": os.pathsep.join(path)}
    allowed = [name.strip() for name in env.get(PLUGINS_ENV, "").split(",") if name.strip()]
    if allowed and ENGINE_PLUGIN_NAME not in allowed:
        out[PLUGINS_ENV] = ",".join([*allowed, ENGINE_PLUGIN_NAME])
    if engine.nnodes == 1:
        interface: str | None = LOOPBACK_INTERFACE
        unset = [name for name in SOCKET_IFNAME_ENVS if name not in engine.env]
    else:
        unset = [name for name in SOCKET_IFNAME_ENVS if not env.get(name)]
        assert engine.dist_init_addr is not None  # the config requires it when nnodes > 1
        host = dist_init_host(engine.dist_init_addr)
        interface = (find_interface or interface_toward)(host) if unset else None
        if unset and interface is None:
            logger.warning("no local interface reaches dist_init_addr {}: {} left to gloo/NCCL", host, ", ".join(unset))
    if interface is not None:
        out.update({name: interface for name in unset})
    return out


def dist_init_host(dist_init_addr: str) -> str:
    """``host:port`` / ``[v6]:port`` -> host."""
    host = dist_init_addr.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def interface_toward(host: str) -> str | None:
    """The interface this machine reaches ``host`` through (None if ``host`` does not resolve or has no route).

    On the machine of rank 0 ``host`` is one of its own addresses, on the others the route to it: either
    way the interface holding the source address the kernel picks.
    """
    try:
        source = source_address_toward(host)
    except OSError:
        return None
    return interface_holding(source, interface_addresses())


def source_address_toward(host: str) -> IPAddress:
    """The local address a connection to ``host`` leaves from (a UDP ``connect`` sends nothing: it only routes)."""
    family, _type, _proto, _name, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return ipaddress.ip_address(probe.getsockname()[0].split("%")[0])


def interface_holding(address: IPAddress, interfaces: Mapping[str, list[IPAddress]]) -> str | None:
    """The interface that has ``address`` (a loopback address not listed, like 127.0.1.1, is loopback's)."""
    for name, addresses in interfaces.items():
        if address in addresses:
            return name
    return LOOPBACK_INTERFACE if address.is_loopback else None


_SIOCGIFADDR = 0x8915  # linux/sockios.h


def interface_addresses() -> dict[str, list[IPAddress]]:
    """Each interface's addresses: IPv4 from ``SIOCGIFADDR`` (its primary one), IPv6 from ``/proc/net/if_inet6``."""
    found: dict[str, list[IPAddress]] = {name: [] for _index, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in found:
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            found[name].append(ipaddress.IPv4Address(answer[20:24]))
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            found.setdefault(fields[5], []).append(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    return found
