"""What the relay writes to the client, seen at a raw socket, against a FAKE engine (a thread in the test: the real
engine cannot be made to wait on demand between its head and its first event).

The response's head (status line, headers) goes out with the stream's first events, in one write: one system
call and one segment less per stream, and the client is woken once.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from contextlib import AbstractContextManager

from tests.fake_upstreams import SSE_HEAD, fake_answering_upstream, http_chunk, read_request
from tests.gateway_server import serve

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
END = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


def _engine_that_waits_after_its_head(wait_s: float) -> AbstractContextManager[str]:
    """Answers each request with its head at once, then (``wait_s`` later) one event and the end."""

    def answer(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(SSE_HEAD)
        time.sleep(wait_s)
        conn.sendall(http_chunk(EVENT) + http_chunk(END) + b"0\r\n\r\n")

    return fake_answering_upstream(answer)


def _streamed_chat(url: str) -> socket.socket:
    """A raw client connection to the gateway at ``url`` that has sent one streamed chat request."""
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    host, port = url.removeprefix("http://").rsplit(":", 1)
    client = socket.create_connection((host, int(port)), timeout=10)
    client.sendall(request)
    return client


def test_the_head_of_a_stream_reaches_the_client_with_its_first_event() -> None:
    with _engine_that_waits_after_its_head(0.3) as engine, serve({"m": {"url": engine}}) as gateway:
        with _streamed_chat(gateway.url) as client:
            first = client.recv(65536)  # whatever came first: the head alone, 0.3 s before the event, or both
            assert first.startswith(b"HTTP/1.1 200"), first
            assert EVENT in first, first  # the head waited for the event and went out with it
            rest = first
            while not rest.endswith(b"0\r\n\r\n"):
                more = client.recv(65536)
                assert more, rest
                rest += more
        assert b"data: [DONE]" in rest


def test_done_reaches_the_client_before_the_engine_closes_its_body() -> None:
    """The client's stream ends at the engine's [DONE], not when the engine gets round to closing the body (a
    decode loop may do that a step later): the engine here closes it only once the client has seen [DONE]."""
    seen_done = threading.Event()

    def answer(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(SSE_HEAD + http_chunk(EVENT) + http_chunk(END))
        seen_done.wait(30)
        conn.sendall(b"0\r\n\r\n")

    with fake_answering_upstream(answer) as url, serve({"m": {"url": url}}) as gateway:
        with _streamed_chat(gateway.url) as client:
            received = b""
            while b"data: [DONE]" not in received:
                more = client.recv(65536)  # times out (10 s) if [DONE] waits for the body's close
                assert more, received
                received += more
            assert not received.endswith(b"0\r\n\r\n")  # the body is still open: [DONE] came first
            seen_done.set()
            while not received.endswith(b"0\r\n\r\n"):
                more = client.recv(65536)
                assert more, received
                received += more


def _data_segments_in(sock: socket.socket) -> int:
    """TCP segments carrying data that ``sock`` received (Linux ``tcp_info.tcpi_data_segs_in``): one per write
    of the gateway's, each well under the loopback's MSS here."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("I", info, 152)[0]


def _read_to_the_end(client: socket.socket) -> bytes:
    received = b""
    while not received.endswith(b"0\r\n\r\n"):
        more = client.recv(65536)
        assert more, received
        received += more
    return received


def test_a_short_answer_reaches_the_client_in_one_write() -> None:
    """An answer that came whole from the engine (in one read) goes out whole: head, events and the body's closing
    chunk in one write (one segment), not the closing chunk in a write of its own."""

    def answer(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(SSE_HEAD + http_chunk(EVENT) + http_chunk(END) + b"0\r\n\r\n")  # one segment: one read

    with fake_answering_upstream(answer) as url, serve({"m": {"url": url}}) as gateway:
        with _streamed_chat(gateway.url) as client:
            received = _read_to_the_end(client)
            assert received.startswith(b"HTTP/1.1 200") and EVENT in received and b"data: [DONE]" in received, received
            assert _data_segments_in(client) == 1


def test_the_last_events_of_a_stream_go_out_with_its_end() -> None:
    """The read that brings the engine's end (its last events and the body's close, together) costs the client one
    write: the events and the closing chunk in one segment."""
    seen_event = threading.Event()

    def answer(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(SSE_HEAD + http_chunk(EVENT))
        seen_event.wait(30)
        conn.sendall(http_chunk(END) + b"0\r\n\r\n")  # one segment: one read

    with fake_answering_upstream(answer) as url, serve({"m": {"url": url}}) as gateway:
        with _streamed_chat(gateway.url) as client:
            received = b""
            while EVENT not in received:
                more = client.recv(65536)
                assert more, received
                received += more
            assert _data_segments_in(client) == 1 and b"[DONE]" not in received
            seen_event.set()
            received += _read_to_the_end(client)
            assert b"data: [DONE]" in received
            assert _data_segments_in(client) == 2  # the head with the first event; the last events with the end
