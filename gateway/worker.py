"""One data-plane worker process: ``python -m gateway.worker`` (started by the control process, never by hand).

It dies with the control process (parent-death signal), asks it for the routing state, binds the public port
with a socket of its own (``SO_REUSEPORT``), tells the control it listens, and serves until SIGTERM (graceful:
its requests finish for up to ``gateway.shutdown_grace_s``). Told by the control process that it drains
(``gateway.shutdown_delay_s``), its ``/ready`` answers 503 and the control's SIGTERM at the end stops it at once;
a SIGTERM of its own (sent to the whole process group) drains first, as the only process does.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from loguru import logger

from gateway.app import create_app
from gateway.console import configure_logging
from gateway.control import channel
from gateway.control.worker_link import WorkerLink
from gateway.control.workers import ADMIN_SOCKET, HUB_SOCKET
from gateway.core.registry import Registry
from gateway.server import GatewayServer, uvicorn_config, with_open_file_budget
from launch.procgroup import set_parent_death_signal


def listening_socket(host: str, port: int) -> socket.socket:
    """The public port, shared with the other workers: the kernel hands each new connection to one of them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.worker")
    parser.add_argument("--runtime-dir", type=Path, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)  # how many share the named keys' limits
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    set_parent_death_signal()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # reloads are the control process's (it is the one signalled)
    if os.getppid() != args.parent:  # the control process died before the death signal was armed
        return 1
    hub = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hub.connect(str(args.runtime_dir / HUB_SOCKET))
    channel.send_blocking(hub, ("hello", args.index, os.getpid()))
    kind, version, routing = channel.receive_blocking(hub)
    settings = routing.settings
    link = WorkerLink(hub, args.index, version, routing, str(args.runtime_dir / ADMIN_SOCKET), count=args.workers)
    app = create_app(settings, Registry(), link=link)
    settings = with_open_file_budget(settings)
    try:
        sock = listening_socket(settings.host, settings.port)
    except OSError as error:
        logger.error("worker {}: cannot listen on {}:{}: {}", args.index, settings.host, settings.port, error)
        return 1
    config = uvicorn_config(app, settings, log_level="debug" if args.verbose else "warning")
    server = GatewayServer(config, on_started=link.listening)
    logging.getLogger("uvicorn.error").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
