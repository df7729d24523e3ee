"""sglang-gateway's SGLang plugin: the engine's torch TCPStore listens on its own address, not on all of them.

Why this exists: SGLang meets its ranks through ``tcp://HOST:PORT`` (``--host`` on one machine,
``--dist-init-addr`` across machines), and torch's rank 0 then serves a ``TCPStore`` there. torch 2.14 binds
that server to *every* interface (``::`` / ``0.0.0.0``, both backends, no setting or environment variable
chooses the address), and the store has no authentication: anyone who reaches the port can write or
delete keys in the scheduler's memory. The one hook torch offers is ``TCPStore(master_listen_fd=...)``: a
socket the caller already bound. So rank 0's store is created here on a socket bound to the address the
other ranks connect to (``HOST`` resolved; a wildcard ``HOST`` becomes loopback, which is where a connection
to ``0.0.0.0`` / ``::`` lands on Linux).

How it gets in: SGLang 0.5.23 loads the ``sglang.srt.plugins`` entry points at the start of every one of its
processes (``sglang.srt.plugins.load_plugins``: server, scheduler, detokenizer, DP controller) and its
``HookRegistry`` wraps any dotted target. This directory, with its ``.dist-info``, is on the *engine's*
``PYTHONPATH`` only (``launch/engine_net.py``); it imports nothing of the gateway.

The same entry point also makes the engine act on SIGTERM at once (:mod:`.prompt_sigterm`), lets LoRA run on a
CPU engine (:mod:`.cpu_pinned_memory`), has a CPU engine fork its children instead of spawning them
(:mod:`.fork_children`) and ends a forced tool call's answer at the call (:mod:`.forced_calls_end`; parallel calls:
:mod:`.parallel_calls_end`).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "torch.distributed.rendezvous._create_c10d_store"


def register() -> None:
    """The entry point SGLang calls: wrap torch's store factory, SGLang's SIGTERM watchdog (:mod:`.prompt_sigterm`)
    and, on a CPU engine, its choice of start method (:mod:`.fork_children`), and ends a forced tool call's grammar after
    the call (:mod:`.forced_calls_end`) and forced parallel calls' turn after them (:mod:`.parallel_calls_end`); SGLang
    applies the hooks right after."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_gateway_engine_plugin import (
        cpu_pinned_memory,
        forced_calls_end,
        fork_children,
        parallel_calls_end,
        prompt_sigterm,
    )

    HookRegistry.register(TARGET, serve_store_on_its_address, HookType.AROUND)
    prompt_sigterm.register()
    cpu_pinned_memory.register()
    fork_children.register()
    forced_calls_end.register()
    parallel_calls_end.register()


def listen_address(hostname: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    """Family and socket address to bind a store meant to be reached at ``hostname:port``.

    The first address ``getaddrinfo`` gives is the one torch's clients try first; a wildcard becomes the
    loopback address of its family.
    """
    family, _type, _proto, _name, sockaddr = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)[0]
    if sockaddr[0] in ("0.0.0.0", "::"):
        loopback = "127.0.0.1" if family == socket.AF_INET else "::1"
        sockaddr = (loopback, *sockaddr[1:])
    return family, sockaddr


def bound_listener(hostname: str, port: int) -> socket.socket:
    """A listening socket on ``hostname``'s address (what torch's own server would be, minus the wildcard)."""
    family, sockaddr = listen_address(hostname, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libuv and torch's own sockets do
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def _agent_store_serves(hostname: str, port: int) -> bool:
    """Whether torchelastic's agent hosts this store (then rank 0 is only a client: nothing to bind)."""
    # importlib: ``torch.distributed.rendezvous`` the attribute is a function that shadows the module
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    check = getattr(rendezvous, "_agent_store_serves", None)
    if check is not None:
        return bool(check(hostname, port))
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def serve_store_on_its_address(
    original: Callable[..., Any],
    hostname: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: Any,
    use_libuv: bool = True,
) -> Any:
    """AROUND ``_create_c10d_store``: rank 0 serves the store on a socket bound here; anything else is torch's."""
    if rank != 0 or _agent_store_serves(hostname, port):
        return original(hostname, port, rank, world_size, timeout, use_libuv)
    try:
        sock = bound_listener(hostname, port)
    except OSError as error:
        # EADDRINUSE: this process may already serve the port (torch's multi-tenant cache reuses that server),
        # or another holds it; torch's own call then behaves exactly as without this plugin.
        logger.warning("sglang-gateway: cannot bind the TCPStore to %s:%s (%s); torch binds it", hostname, port, error)
        return original(hostname, port, rank, world_size, timeout, use_libuv)
    from torch.distributed import TCPStore

    bound = sock.getsockname()
    try:
        store = TCPStore(
            host_name=hostname,
            port=bound[1],
            world_size=world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=sock.fileno(),
            use_libuv=use_libuv,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now (Python closing it too would break the server)
    logger.info("sglang-gateway: TCPStore for %s:%s listening on %s only", hostname, port, bound[0])
    return store
