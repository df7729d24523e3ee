"""The gateway's listener takes every waiting connection in one pass of the loop (gateway.edge.listener).

Under uvloop's own server each pass of the loop accepts one connection, so a gateway whose passes are long
(relaying a thousand streams) leaves new streams in the listen queue. These tests count loop passes on real
sockets under uvloop, and check what a server needs of its listener: it stops when closed, leaves a socket it
was handed to its owner, and waits (not fails) while the process is out of file descriptors; the control process's
Unix socket takes connections before its lifespan ends.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

from gateway.edge.listener import ManyAcceptListener, bind_listening_sockets

WAITING = 300


class _Served(asyncio.Protocol):
    """Counts connections made and answers each one's first bytes with b"ok"."""

    made: list[asyncio.Transport]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.made.append(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self.transport.write(b"ok")


def _factory(made: list[asyncio.Transport]) -> type[_Served]:
    return type("Served", (_Served,), {"made": made})


async def _passes_until(made: list[asyncio.Transport], count: int, limit: int = 5000) -> int:
    passes = 0
    while len(made) < count and passes < limit:
        await asyncio.sleep(0)
        passes += 1
    return passes


def _waiting_clients(port: int, count: int) -> list[socket.socket]:
    """``count`` connections completed by the kernel and waiting in the listen queue (nothing accepted yet)."""
    clients = []
    for _ in range(count):
        client = socket.create_connection(("127.0.0.1", port))
        clients.append(client)
    return clients


def test_waiting_connections_are_all_accepted_within_a_few_passes() -> None:
    async def main() -> tuple[int, int]:
        made: list[asyncio.Transport] = []
        (sock,) = bind_listening_sockets("127.0.0.1", 0, backlog=2048)
        listener = ManyAcceptListener(sock, _factory(made), owns_socket=True)
        clients = _waiting_clients(sock.getsockname()[1], WAITING)
        try:
            return await _passes_until(made, WAITING), len(made)
        finally:
            listener.close()
            for client in clients:
                client.close()

    passes, served = uvloop.run(main())
    assert served == WAITING
    assert passes <= 5, passes  # uvloop's own server: one pass per connection (301)


def test_uvloops_own_server_takes_one_connection_per_pass() -> None:
    """What the listener is for: if uvloop ever accepts many per pass, this fails and the listener can go."""

    async def main() -> int:
        made: list[asyncio.Transport] = []
        (sock,) = bind_listening_sockets("127.0.0.1", 0, backlog=2048)
        server = await asyncio.get_running_loop().create_server(_factory(made), sock=sock, backlog=2048)
        clients = _waiting_clients(sock.getsockname()[1], 50)
        try:
            return await _passes_until(made, 50)
        finally:
            server.close()
            for client in clients:
                client.close()

    assert uvloop.run(main()) >= 40


def test_a_closed_listener_accepts_nothing_and_leaves_a_handed_socket_open() -> None:
    async def main() -> None:
        made: list[asyncio.Transport] = []
        owned = socket.socket()
        owned.bind(("127.0.0.1", 0))
        owned.listen(16)
        listener = ManyAcceptListener(owned, _factory(made), owns_socket=False)
        assert listener.is_serving() and listener.sockets == (owned,) and listener.get_loop() is asyncio.get_running_loop()
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), 1)
        assert not listener.is_serving() and owned.fileno() != -1  # its owner (uvicorn's shutdown) closes it
        client = socket.create_connection(owned.getsockname())  # queued by the kernel, never accepted
        await asyncio.sleep(0.05)
        assert made == []
        client.close()
        owned.close()

        (bound,) = bind_listening_sockets("127.0.0.1", 0, backlog=16)
        port = bound.getsockname()[1]
        ManyAcceptListener(bound, _factory(made), owns_socket=True).close()
        assert bound.fileno() == -1
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1)

    uvloop.run(main())


def test_out_of_descriptors_the_connection_waits_and_is_served_once_they_are_freed() -> None:
    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        made: list[asyncio.Transport] = []
        (sock,) = bind_listening_sockets("127.0.0.1", 0, backlog=16)
        listener = ManyAcceptListener(sock, _factory(made), owns_socket=True)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest_free = os.open("/dev/null", os.O_RDONLY)
        os.close(lowest_free)
        client = socket.socket()  # takes lowest_free: the limit below leaves none for the accept
        client.setblocking(False)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free + 1, hard))
        try:
            await loop.sock_connect(client, sock.getsockname())
            await asyncio.sleep(0.1)
            assert made == [] and not listener.is_serving()  # accept failed (EMFILE): paused, not closed
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await loop.sock_sendall(client, b"hi")
        answer = await asyncio.wait_for(loop.sock_recv(client, 16), 5)
        assert listener.is_serving() and len(made) == 1
        client.close()
        listener.close()
        return answer

    assert uvloop.run(main()) == b"ok"


_CONTROL_APP = """
import contextlib, os, signal, socket, sys, threading
from fastapi import FastAPI
from gateway.config import GatewaySettings
from gateway.server import serve_app

path = sys.argv[1]
answer: list[bytes] = []

def read_then_stop(client: socket.socket) -> None:
    answer.append(client.makefile("rb").read())
    os.kill(os.getpid(), signal.SIGTERM)

@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)  # a worker asking while the control's lifespan still runs
    client.sendall(b"GET /ping HTTP/1.1\\r\\nhost: control\\r\\nconnection: close\\r\\n\\r\\n")
    threading.Thread(target=read_then_stop, args=(client,), daemon=True).start()
    yield

app = FastAPI(lifespan=lifespan)
app.state.startup_error = None
app.get("/ping")(lambda: "pong")
serve_app(app, GatewaySettings(), uds=path)
print(answer[0].decode(errors="replace").splitlines()[0], os.stat(path).st_mode & 0o777 if os.path.exists(path) else "-")
"""


def test_the_control_socket_takes_connections_while_the_lifespan_runs(tmp_path: Path) -> None:
    """The control process of workers serves its admin API on a Unix socket; its workers listen (and forward
    admin requests) before its lifespan ends. The socket is bound first: such a request waits and is answered,
    where uvicorn's own binding, after the lifespan, made it fail (503 control_unavailable in a loaded CI run)."""
    done = subprocess.run([sys.executable, "-c", _CONTROL_APP, str(tmp_path / "admin.sock")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["HTTP/1.1", "200", "OK", "384"], (done.stdout, done.stderr[-2000:])  # 0o600
