"""The edges of HTTP: what an unauthenticated peer can send before any route runs, and how the gateway answers.

No engine is needed: the one model points at a closed port, and every request here is refused (or
answered) before anything would go upstream. Each test names the hardening finding it covers.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from loguru import logger

from tests.admin_client import prometheus_value
from tests.gateway.helpers import assert_openai_error, closed_port_url
from tests.gateway_server import KEY, GatewayServer, auth, serve
from tests.waiting import wait_until

ADMIN = "admin-key-1"
LIMITS = {
    "max_connections": 8,
    "max_header_bytes": 4096,
    "max_headers": 20,
    "max_url_bytes": 1024,
    "header_timeout_s": 1.0,
    "keepalive_timeout_s": 1.5,
    "body_timeout_s": 1.0,
    "body_deadline_s": 2.5,
}


@pytest.fixture(scope="module")
def edge() -> Iterator[GatewayServer]:
    gateway = {"api_keys": [KEY], "admin_keys": [ADMIN], "cors_allow_origins": ["https://app.example"], "http": LIMITS}
    with serve({"m": {"url": closed_port_url()}}, gateway) as gw:
        yield gw


@contextmanager
def raw_connection(gw: GatewayServer, timeout_s: float = 10.0) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=timeout_s)
    try:
        yield sock
    finally:
        sock.close()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP response until the peer closes (every rejection here closes the connection)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and lines[0].startswith("HTTP/") else 0
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return status, {k.lower(): v for k, v in headers.items()}, body


def assert_json_error(status: int, headers: dict[str, str], body: bytes, expected: int, code: str) -> dict[str, Any]:
    assert status == expected, (status, body)
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == code and error["message"], error
    return error


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


# ------------------------------------------------------------------ header size, count, URL
def test_oversized_header_is_431_without_buffering_it(edge: GatewayServer) -> None:
    with raw_connection(edge) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:  # a header that never ends: the gateway must cut it off, not collect megabytes of it
            while sent < 32 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        # (kernel socket buffers on both ends take a few MB before the peer's close is seen)
        assert sent < 8 * 1024 * 1024, f"the gateway kept reading: {sent} bytes of one header"
        status, headers, body = read_response(sock)
    if status:  # the 431 may be lost when the peer resets the half-sent request; it was sent
        assert_json_error(status, headers, body, 431, "headers_too_large")


def test_oversized_head_arriving_in_one_read_is_431(edge: GatewayServer) -> None:
    """A head over the limit sent in one write (one read on loopback) is parsed whole before data_received
    could count it: it must be counted anyway, whether one big field or many small ones."""
    limit = LIMITS["max_header_bytes"]
    one_big = b"X-Big: " + b"a" * (2 * limit) + b"\r\n"
    many = b"".join(b"X-F%d: %s\r\n" % (i, b"b" * (limit // 8)) for i in range(12))  # 12 fields: under max_headers
    for path, fields in (("/health", one_big), ("/health", many), ("/v1/messages", one_big)):
        with raw_connection(edge) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + fields + b"\r\n")
            status, headers, body = read_response(sock)
        if path == "/v1/messages":  # answered in the route's dialect
            assert status == 431 and json.loads(body)["error"]["type"] == "invalid_request_error", (status, body)
        else:
            assert_json_error(status, headers, body, 431, "headers_too_large")
    with raw_connection(edge) as sock:  # just under the limit, in one read: served
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: " + b"a" * (limit - 200) + b"\r\n\r\n")
        assert read_response(sock)[0] == 200


def test_too_many_headers_and_long_urls(edge: GatewayServer) -> None:
    with raw_connection(edge) as sock:
        fields = b"".join(b"X-H%d: v\r\n" % i for i in range(25))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
        assert_json_error(*read_response(sock), 431, "headers_too_large")
    with raw_connection(edge) as sock:
        sock.sendall(b"GET /health?" + b"q" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert_json_error(*read_response(sock), 414, "uri_too_long")
    response = httpx.get(edge.url + "/health", headers={f"x-h{i}": "v" for i in range(10)}, timeout=10)
    assert response.status_code == 200  # under the limits: served


# ------------------------------------------------------------------ timeouts and the connection cap
def test_idle_and_slow_header_connections_are_closed(edge: GatewayServer) -> None:
    with raw_connection(edge) as idle, raw_connection(edge) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
        assert closed_by_peer(idle, within_s=10), "an idle connection was not closed"
        assert_json_error(*read_response(slow), 408, "request_timeout")
    with raw_connection(edge) as kept:  # between two requests on one connection, the same idle limit
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        kept.settimeout(10)
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_by_peer(kept, within_s=10)


def test_a_body_sent_after_100_continue_is_read_and_answered(edge: GatewayServer) -> None:
    """A client that waits for ``100 Continue`` gets it, then its body is read: the request reaches the model (whose
    engine is down here: 503), not a 400 for a body missing or a 408 for one never asked for."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %b\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (KEY.encode(), len(body))
    )
    with raw_connection(edge) as sock:
        sock.sendall(head)
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert b'"engine_unavailable"' in answer, answer


def test_slow_body_is_408(edge: GatewayServer) -> None:
    with raw_connection(edge) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":"
        )  # fmt: skip
        assert_json_error(*read_response(sock), 408, "request_timeout")


def test_body_trickled_past_the_deadline_is_408() -> None:
    """One byte every 0.1 s, and the whole body must arrive within body_deadline_s (2.5 s): 408 in the route's
    dialect, while the client is still trickling. This gateway's silence limit (body_timeout_s, 10 s) lies past
    the deadline, so only the deadline can end the trickle: with the shared 1 s silence limit, one late wake-up
    of this thread on a loaded 2-core machine read as a silence (it did on CI)."""
    limits = {**LIMITS, "body_timeout_s": 10.0}
    with serve({"m": {"url": closed_port_url()}}, {"api_keys": [KEY], "http": limits}) as gateway:
        for path, dialect in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
            status, headers, body, elapsed = trickle_until_answered(gateway, path)
            assert status == 408 and elapsed < 8, (status, elapsed, body)  # cut off by the deadline, not by a silence
            if dialect == "openai":
                error = assert_json_error(status, headers, body, 408, "request_timeout")
                assert "not complete within 2.5s" in error["message"], error
            else:
                assert json.loads(body) == {"type": "error", "error": {"type": "timeout_error", "message": "request body not complete within 2.5s"}}


def trickle_until_answered(gw: GatewayServer, path: str) -> tuple[int, dict[str, str], bytes, float]:
    """POST ``path`` announcing 1000 body bytes and send one every 0.1 s until the gateway answers (at most 10 s)."""
    with raw_connection(gw) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
        )
        started = time.monotonic()
        answered = False
        while not answered and time.monotonic() - started < 10:
            time.sleep(0.1)
            try:
                sock.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(0)
            try:
                answered = bool(sock.recv(1, socket.MSG_PEEK))
            except BlockingIOError:
                pass
            except ConnectionResetError:
                break
        elapsed = time.monotonic() - started
        sock.settimeout(10)
        status, headers, body = read_response(sock)
    return status, headers, body, elapsed


def test_connection_cap(edge: GatewayServer) -> None:
    held: list[socket.socket] = []
    try:
        for _ in range(LIMITS["max_connections"] + 3):
            held.append(socket.create_connection(("127.0.0.1", edge.port), timeout=10))
        time.sleep(0.3)
        refused = []
        for sock in held:
            sock.settimeout(0.5)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    refused.append(sock)
            except TimeoutError:
                pass
        assert len(refused) >= 3, "connections over max_connections were not refused"
        sock = refused[-1]
        sock.settimeout(10)
        assert_json_error(*read_response(sock), 503, "too_many_connections")
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)
    assert httpx.get(edge.url + "/health", timeout=10).status_code == 200  # serves again once they are gone


# ------------------------------------------------------------------ bodies
def test_deeply_nested_json_is_400_not_500(edge: GatewayServer) -> None:
    for depth in (100, 255, 1024):
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * depth + b"]" * depth + b"}"
        response = httpx.post(edge.url + "/v1/chat/completions", content=body, headers=auth(), timeout=10)
        assert_openai_error(response, 400, "invalid_json")
        message = response.json()["error"]["message"]
        assert "nested deeper" in message or "depth limit" in message, message


def test_client_leaving_mid_body_is_499_without_traceback(edge: GatewayServer) -> None:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="DEBUG")
    try:
        with raw_connection(edge) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                + b"\r\nContent-Length: 1000\r\n\r\n{\"model\": \"m\""
            )  # fmt: skip
            time.sleep(0.2)
        wait_until(lambda: any("status=499" in line for line in lines), "the request's log line with status=499", 10, every_s=0.05)
    finally:
        logger.remove(sink)
    request_lines = [line for line in lines if "path=/v1/chat/completions" in line]
    assert request_lines and "status=499" in request_lines[-1] and "client disconnected" in request_lines[-1]
    assert not any("Traceback" in line or "unhandled error" in line for line in lines), lines
    metrics = httpx.get(edge.url + "/metrics", headers=auth(ADMIN), timeout=10).text  # every series: the admin's
    assert (prometheus_value(metrics, "gateway_requests_total", {"route": "/v1/chat/completions", "status": "500"}) or 0) == 0
    assert (prometheus_value(metrics, "gateway_requests_total", {"route": "/v1/chat/completions", "status": "499"}) or 0) >= 1


# ------------------------------------------------------------------ log injection
def test_request_path_cannot_forge_log_lines(edge: GatewayServer) -> None:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO", format="{message}")
    try:
        with raw_connection(edge) as sock:
            sock.sendall(b"GET /x%0a2026-01-01%20|%20INFO%20|%20forged%00nul HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nConnection: close\r\n\r\n")
            status, _, _ = read_response(sock)
        assert status == 404
        wait_until(lambda: any("forged" in line for line in lines), "the request's log line", 5, every_s=0.05)
    finally:
        logger.remove(sink)
    forged = [line for line in lines if "forged" in line]
    assert len(forged) == 1, forged
    assert "\\x0a" in forged[0] and "\\x00" in forged[0]
    assert forged[0].count("\n") == 1 and "\x00" not in forged[0]  # the sink's own line end only


# ------------------------------------------------------------------ every answer in the API's dialect
def test_parser_errors_cors_refusals_and_trailing_slashes_are_json(edge: GatewayServer) -> None:
    with raw_connection(edge) as sock:
        sock.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        assert_json_error(*read_response(sock), 400, "invalid_http_request")
    preflight = httpx.options(
        edge.url + "/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        timeout=10,
    )
    assert_openai_error(preflight, 400, "cors_refused")
    allowed = httpx.options(
        edge.url + "/v1/chat/completions",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
        timeout=10,
    )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    slash = httpx.post(edge.url + "/v1/chat/completions/", json={}, headers={**auth(), "Host": "evil.example"}, timeout=10)
    assert "location" not in slash.headers
    assert_openai_error(slash, 404)


def test_head_on_health_routes_and_no_admin_routes_in_openapi(edge: GatewayServer) -> None:
    # The module's one model points at a closed port: alive, not ready; HEAD answers as GET does, without a body.
    for path, status in (("/health", 200), ("/ready", 503)):
        head = httpx.head(edge.url + path, timeout=10)
        assert (head.status_code, head.content) == (status, b""), (path, head.status_code, head.content)
        assert httpx.get(edge.url + path, timeout=10).status_code == status, path
    spec = httpx.get(edge.url + "/openapi.json", headers=auth(), timeout=10)
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    assert "/v1/chat/completions" in paths and not [p for p in paths if p.startswith("/admin")]
    # the admin routes themselves still work for admin keys
    assert httpx.get(edge.url + "/admin/models", headers=auth(ADMIN), timeout=10).status_code == 200
