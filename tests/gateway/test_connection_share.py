"""A key's share of the client connections, and the lingering close of every rejection.

An fd-starved gateway has few connections (``http.max_connections`` is lowered to what the open-file limit fits:
14 at 300 descriptors). One key holding them all denied every other key; now a key gets at most its share (half,
by default) and the others keep room. And a rejected client that had sent its request body at once got a
connection reset instead of the 503: the gateway closed a socket with unread bytes, which resets it, and the
client's TCP stack dropped the answer it had not read."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator

import pytest

from tests.gateway.helpers import closed_port_url
from tests.gateway.test_http_edges import read_response
from tests.gateway_server import GatewayServer, serve
from tests.waiting import wait_until

A, B = "sk-holds-many-connections", "sk-another-tenant"


@pytest.fixture(scope="module")
def small() -> Iterator[GatewayServer]:
    with serve({"m": {"url": closed_port_url()}}, {"api_keys": [A, B], "http": {"max_connections": 4}}) as gw:
        yield gw


def _request(key: str, body: bytes = b"") -> bytes:
    method = b"POST /v1/chat/completions" if body else b"GET /v1/models"
    head = method + b" HTTP/1.1\r\nhost: t\r\nauthorization: Bearer " + key.encode() + b"\r\n"
    return head + (b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body if body else b"\r\n")


def _status_keeping_alive(sock: socket.socket) -> int:
    """The status of one response on a kept-alive connection (read to its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(head.split()[1]) if head.startswith(b"HTTP/") else 0


def test_one_key_holds_at_most_its_share_of_the_connections(small: GatewayServer) -> None:
    held: list[socket.socket] = []
    try:
        statuses = []
        for _ in range(4):  # every connection the gateway has
            sock = socket.create_connection(("127.0.0.1", small.port), timeout=10)
            sock.sendall(_request(A))
            statuses.append(_status_keeping_alive(sock))
            held.append(sock)
        assert statuses == [200, 200, 503, 503], statuses  # its share: half of max_connections
        for sock in held[2:]:  # the refused ones were closed after their answer
            assert read_response(sock)[0] == 0
            sock.close()

        def another_key_is_served() -> bool:
            with socket.create_connection(("127.0.0.1", small.port), timeout=10) as other:
                other.sendall(_request(B))
                return _status_keeping_alive(other) == 200

        wait_until(another_key_is_served, "another key's request to be served beside the first key's two connections", 10)
        again = held[0]
        again.sendall(_request(A))  # the key's own connections go on serving it
        assert _status_keeping_alive(again) == 200
    finally:
        for sock in held:
            sock.close()


def test_a_rejected_client_that_sends_its_body_reads_the_503_not_a_reset(small: GatewayServer) -> None:
    held = [socket.create_connection(("127.0.0.1", small.port), timeout=10) for _ in range(4)]  # the gateway is full
    try:
        for sock in held:  # each accepted (a request answered on it)
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
            assert _status_keeping_alive(sock) == 200
        body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 100_000 + b'"}]}'
        client = http.client.HTTPConnection("127.0.0.1", small.port, timeout=10)  # it sends all, then reads (as requests)
        try:
            client.connect()  # refused at once: the 503 comes, then the gateway's end of the connection
            with socket.create_connection(("127.0.0.1", small.port), timeout=10) as probe:  # (refused as well: once its
                assert read_response(probe)[0] == 503  # whole answer came, the gateway handled the first one too)
            client.request("POST", "/v1/chat/completions", body=body, headers={"authorization": f"Bearer {B}", "content-type": "application/json"})
            answer = client.getresponse()
            assert answer.status == 503 and json.loads(answer.read())["error"]["code"] == "too_many_connections"
        finally:
            client.close()
    finally:
        for sock in held:
            sock.close()
