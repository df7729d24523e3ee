"""The stream relay's upstream pool (``gateway.data.stream_pool``), against small asyncio servers in the test.

These servers are FAKES: the real engine cannot be made, on demand, to close a kept-alive connection just as
it is reused, to go silent after its headers, or to answer on a connection the gateway must count.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from gateway.data.loop_lag import LoopLag
from gateway.data.stream_pool import (
    StreamPool,
    UpstreamConnectionLost,
    UpstreamPoolFull,
    UpstreamReadTimeout,
    UpstreamUnreachable,
)
from tests.gateway.test_upstream_session import _sse_server

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Behind:
    """Stands in for the loop's lag probe: the process is ``lag_s`` behind, however fast the test's loop runs
    (a test cannot make a machine busy on demand, and must not depend on how busy it is)."""

    def __init__(self, lag_s: float) -> None:
        self.lag_s = lag_s

    def start(self) -> None:
        pass


class _Server:
    """A keep-alive HTTP/1.1 server in the test's loop; ``handler(reader, writer, n)`` answers request ``n`` of a connection."""

    def __init__(self, handler) -> None:  # type: ignore[no-untyped-def]
        self.handler = handler
        self.connections = 0
        self.closed_by_client = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                n += 1
                if not await self.handler(reader, writer, n):
                    break
            if await reader.read(1) == b"":
                self.closed_by_client += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


async def _two_events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    writer.write(HEAD + b"9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n0\r\n\r\n")
    await writer.drain()
    return True


async def _relayed_calls(pool: StreamPool, url: str) -> tuple[list[bytes], BaseException | None]:
    """One stream relayed to its end: what each call of the relay got (one call per read), and how it ended."""
    exchange = await pool.request(url, "/v1/chat/completions", b"{}", {"Content-Type": "application/json"})
    calls: list[bytes] = []
    ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    exchange.relay(calls.append, lambda error: ended.done() or ended.set_result(error))
    error = await asyncio.wait_for(ended, 10)
    exchange.release()
    return calls, error


async def _relayed(pool: StreamPool, url: str) -> tuple[bytes, BaseException | None]:
    calls, error = await _relayed_calls(pool, url)
    return b"".join(calls), error


async def _relay_calls(pool: StreamPool, url: str) -> list[bytes]:
    """What each call of the relay got, for a stream that must end well."""
    calls, error = await _relayed_calls(pool, url)
    assert error is None
    return calls


def test_connections_are_kept_alive_and_reused_and_a_stream_cut_short_closes_its_connection() -> None:
    async def main() -> None:
        fake = _Server(_two_events)
        async with fake as url:
            pool = StreamPool(5.0, 30.0)
            for _ in range(3):
                assert await _relayed(pool, url) == (b"data: a\n\ndata: b\n\n", None)
            assert fake.connections == 1 and pool.busy == 0  # one connection, reused

            held = _Server(lambda reader, writer, n: _head_then_silence(writer))
            async with held as slow_url:
                exchange = await pool.request(slow_url, "/x", b"{}", {})
                exchange.close()  # the client went away: the engine must see the connection close
                for _ in range(100):
                    if held.closed_by_client:
                        break
                    await asyncio.sleep(0.02)
                assert held.closed_by_client == 1 and pool.busy == 0
            await pool.close()

    asyncio.run(main())


def test_what_came_with_the_head_is_relayed_in_one_call() -> None:
    """An engine that answered at once (head, events and end in one read): the relay gets its events in one call,
    so the client gets them in one write, not one write per event."""

    async def main() -> list[bytes]:
        async with _Server(_two_events) as url:
            pool = StreamPool(5.0, 30.0)
            calls = await _relay_calls(pool, url)  # the head came, and with it the rest
            await pool.close()
            return calls

    assert asyncio.run(main()) == [b"data: a\n\ndata: b\n\n"]


async def _head_then_silence(writer: asyncio.StreamWriter) -> bool:
    writer.write(HEAD)
    await writer.drain()
    return True


def test_the_events_one_read_brings_reach_the_relay_in_one_call() -> None:
    """An engine that got ahead of the gateway (several events waiting in the socket, as under load) costs one
    write to the client per read, not one per event: the chunks of one read reach the sink joined."""

    async def bursts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD)
        await writer.drain()
        await asyncio.sleep(0.05)  # the relay has started
        writer.write(b"9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n9\r\ndata: c\n\n\r\n")  # one write, three events
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"9\r\ndata: d\n\n\r\n9\r\ndata: e\n\n\r\n0\r\n\r\n")  # two more and the end
        await writer.drain()
        return True

    async def main() -> list[bytes]:
        async with _Server(bursts) as url:
            pool = StreamPool(5.0, 30.0)
            exchange = await pool.request(url, "/", b"{}", {})
            calls: list[bytes] = []
            ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
            exchange.relay(calls.append, lambda error: ended.done() or ended.set_result(error))
            assert await ended is None
            exchange.release()
            await pool.close()
            return calls

    assert asyncio.run(main()) == [b"data: a\n\ndata: b\n\ndata: c\n\n", b"data: d\n\ndata: e\n\n"]


def test_a_malformed_chunk_ends_the_relay_after_the_events_before_it_in_the_same_read() -> None:
    async def garbled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD)
        await writer.drain()
        await asyncio.sleep(0.05)  # the relay has started
        writer.write(b"9\r\ndata: a\n\n\r\nzz\r\nnot a chunk\r\n")  # one good event, then a chunk size that is not hex
        await writer.drain()
        await asyncio.sleep(1)
        return False

    async def main() -> None:
        async with _Server(garbled) as url:
            pool = StreamPool(5.0, 30.0)
            body, error = await _relayed(pool, url)
            assert body == b"data: a\n\n"
            assert isinstance(error, UpstreamConnectionLost) and "malformed response" in str(error), error
            assert pool.busy == 0
            await pool.close()

    asyncio.run(main())


async def _ticking(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    """Twelve events 10 ms apart, as a decode loop sends them, then the end (keep-alive)."""
    writer.write(HEAD)
    for i in range(12):
        await asyncio.sleep(0.01)
        writer.write(b"9\r\ndata: %x\n\n\r\n" % i)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


def test_a_resting_exchange_relays_what_came_meanwhile_in_one_call_and_its_connection_is_reused() -> None:
    """A process behind its work: after each read it relayed, the exchange reads nothing for its rest (here the
    ceiling, ``stream_coalesce_ms``); the events sent meanwhile arrive together. The connection goes back to the
    pool reading (the next request is answered)."""

    async def main() -> list[list[bytes]]:
        fake = _Server(_ticking)
        async with fake as url:
            pool = StreamPool(5.0, 30.0, coalesce_s=0.05, lag=Behind(0.02))
            streams = [await _relay_calls(pool, url) for _ in range(2)]
            assert fake.connections == 1 and pool.busy == 0
            await pool.close()
            return streams

    every = b"".join(b"data: %x\n\n" % i for i in range(12))
    for calls in asyncio.run(main()):
        assert b"".join(calls) == every
        assert len(calls) <= 6, calls  # 12 events over ~120 ms, read at most every 50 ms (each read: one call)


def test_a_process_that_keeps_up_never_rests_and_one_behind_rests_as_its_lag_says() -> None:
    """Under 5 ms of mean loop lag every read is relayed as it comes; beyond, a stream rests 8x the lag (a rest
    must span a few decode steps to save a read), up to ``stream_coalesce_ms``; 0 there: never."""
    lagging = Behind(0.0)
    pool = StreamPool(5.0, 30.0, coalesce_s=0.1, lag=lagging)
    rests = []
    for lag_s in (0.0, 0.004, 0.005, 0.01, 0.5):
        lagging.lag_s = lag_s
        rests.append(pool.rest_for())
    assert rests == [0.0, 0.0, 0.04, 0.08, 0.1]
    assert StreamPool(5.0, 30.0, coalesce_s=0.0, lag=Behind(0.5)).rest_for() == 0.0


def test_the_loop_lag_is_how_late_a_timer_runs_and_is_probed_only_while_wanted() -> None:
    """A loop whose callbacks hold it 20 ms at a time runs the probe late; once nothing is wanted, it stops."""

    async def main() -> tuple[float, float, bool]:
        loop = asyncio.get_running_loop()
        wanted = True
        lag = LoopLag(lambda: wanted)
        lag.start()
        await asyncio.sleep(0.1)
        idle = lag.lag_s
        busy_until = loop.time() + 0.3
        while loop.time() < busy_until:  # the loop's own work holds it 20 ms at a time
            time.sleep(0.02)
            await asyncio.sleep(0)
        behind = lag.lag_s
        wanted = False
        await asyncio.sleep(0.05)
        return idle, behind, lag._running

    idle, behind, running = asyncio.run(main())
    assert behind >= 0.005 and behind > idle, (idle, behind)
    assert not running


def test_streams_rest_only_while_the_pool_carries_stream_coalesce_min_streams() -> None:
    """Behind its work, one stream alone (under the minimum of 2) still gets each event as it comes; two at once
    both rest."""

    async def main() -> tuple[list[bytes], list[list[bytes]]]:
        async with _Server(_ticking) as url:
            pool = StreamPool(5.0, 30.0, coalesce_s=0.05, coalesce_min_streams=2, lag=Behind(0.02))
            assert pool.rest_for() == 0.0
            alone = await _relay_calls(pool, url)
            together = await asyncio.gather(_relay_calls(pool, url), _relay_calls(pool, url))
            await pool.close()
            return alone, together

    alone, together = asyncio.run(main())
    every = b"".join(b"data: %x\n\n" % i for i in range(12))
    assert b"".join(alone) == every and len(alone) >= 10, alone  # 12 events 10 ms apart: read one by one
    for calls in together:
        assert b"".join(calls) == every and len(calls) <= 6, calls  # read at most every 50 ms


async def _finishing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    """Two events, a finish event, then [DONE], each 80 ms after the last (longer than the test's rest), then the end."""
    writer.write(HEAD)
    for event in (b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b'data: {"finish_reason":"stop"}\n\n', b"data: [DONE]\n\n"):
        await asyncio.sleep(0.08)
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


def test_a_read_that_carries_a_streams_finish_is_not_followed_by_a_rest() -> None:
    """The end (usage, [DONE], the engine's slot) follows a finish event at once: that read is not rested on."""

    async def main(says_finishing: bool) -> list[tuple[bytes, bool]]:
        async with _Server(_finishing) as url:
            pool = StreamPool(5.0, 30.0, coalesce_s=0.04, lag=Behind(0.02))
            exchange = await pool.request(url, "/", b"{}", {})
            transport = exchange.connection.transport
            loop = asyncio.get_running_loop()
            reads: list[tuple[bytes, bool]] = []

            def sink(body: bytes) -> None:  # is the connection read on, once the read's callback returned?
                loop.call_soon(lambda: reads.append((body, transport.is_reading())))

            def finishing(body: bytes) -> bool:  # as the relay's scan says
                return says_finishing and b'"finish_reason":"' in body

            ended: asyncio.Future[BaseException | None] = loop.create_future()
            exchange.relay(sink, _end_into(ended), finishing)
            assert await asyncio.wait_for(ended, 10) is None
            exchange.release()
            await pool.close()
            return reads

    marked = asyncio.run(main(True))
    finish = [reading for body, reading in marked if b"finish_reason" in body]
    assert finish == [True], marked  # read on at once
    assert [reading for body, reading in marked if b"finish_reason" not in body and b"DONE" not in body] == [False, False], marked
    unmarked = asyncio.run(main(False))
    assert [reading for body, reading in unmarked if b"finish_reason" in body] == [False], unmarked  # rested on


def test_rests_that_begin_close_together_end_on_one_tick() -> None:
    """One timer per 5 ms tick, not per rest: streams that rested together are read together."""

    class Resting:
        def __init__(self) -> None:
            self.woken: list[float] = []

        def rested(self, at: float) -> None:
            self.woken.append(at)

    async def main() -> None:
        pool = StreamPool(5.0, 30.0, coalesce_s=0.08)
        loop = asyncio.get_running_loop()
        first, second, later = Resting(), Resting(), Resting()
        tick = 0.005
        while not 0.05 < ((loop.time() + 0.08) / tick) % 1 < 0.5:  # early in a tick: both rests begin within it
            pass
        began = loop.time()
        at = pool.wake_later(first, 0.08)  # type: ignore[arg-type]
        assert pool.wake_later(second, 0.08) == at  # the same tick
        assert began + 0.08 <= at <= began + 0.08 + tick  # at least the rest, at most a tick more
        await asyncio.sleep(0.012)
        assert pool.wake_later(later, 0.08) > at  # a tick later: the next one
        await asyncio.sleep(0.2)
        assert first.woken == second.woken == [at] and len(later.woken) == 1
        await pool.close()

    asyncio.run(main())


def test_a_stream_cut_while_it_rests_closes_its_connection_at_once() -> None:
    """A client that goes away during a rest: the engine sees the connection close then, not at the rest's end."""

    async def main() -> None:
        held = _Server(lambda reader, writer, n: _head_then_silence(writer))
        async with held as url:
            pool = StreamPool(5.0, 30.0, coalesce_s=0.5)
            exchange = await pool.request(url, "/", b"{}", {})
            exchange.rest(0.5)
            exchange.close()
            for _ in range(20):
                if held.closed_by_client:
                    break
                await asyncio.sleep(0.01)
            assert held.closed_by_client == 1 and pool.busy == 0  # well within the rest
            await asyncio.sleep(0.6)  # the rest's tick comes and finds nothing to wake
            assert pool.busy == 0
            await pool.close()

    asyncio.run(main())


def test_a_rest_and_a_full_client_socket_both_hold_reading_until_each_is_over() -> None:
    async def main() -> None:
        async with _Server(lambda reader, writer, n: _head_then_silence(writer)) as url:
            pool = StreamPool(5.0, 30.0)
            exchange = await pool.request(url, "/", b"{}", {})
            transport = exchange.connection.transport
            exchange.pause_reading()  # the client's socket is full
            exchange.rest(0.01)
            await asyncio.sleep(0.05)  # the rest is over, the client's pause is not
            assert not transport.is_reading()
            exchange.resume_reading()
            assert transport.is_reading()
            exchange.rest(0.01)
            assert not transport.is_reading()
            await asyncio.sleep(0.05)
            assert transport.is_reading()
            exchange.close()
            await pool.close()

    asyncio.run(main())


def test_a_connection_whose_stream_ended_while_reading_was_held_goes_back_to_the_pool_reading() -> None:
    """The last events and the end came in one read, and relaying them filled the client's socket (reading
    held): the next request on that kept-alive connection is still read."""

    async def main() -> None:
        fake = _Server(_two_events)
        async with fake as url:
            pool = StreamPool(5.0, 30.0)
            exchange = await pool.request(url, "/", b"{}", {})
            ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
            exchange.relay(lambda _: exchange.pause_reading(), lambda error: ended.done() or ended.set_result(error))
            assert await ended is None
            exchange.release()
            assert await asyncio.wait_for(_relayed(pool, url), 5) == (b"data: a\n\ndata: b\n\n", None)
            assert fake.connections == 1
            await pool.close()

    asyncio.run(main())


def test_a_silence_check_that_falls_in_a_rest_waits_for_what_came_meanwhile() -> None:
    """A read timeout (0.15 s) shorter than the rest (0.3 s): the engine is not silent, it is not being read."""

    async def main() -> tuple[bytes, BaseException | None]:
        async with _Server(_ticking) as url:
            pool = StreamPool(5.0, 0.15, coalesce_s=0.3, lag=Behind(1.0))
            result = await _relayed(pool, url)
            await pool.close()
            return result

    body, error = asyncio.run(main())
    assert error is None and body == b"".join(b"data: %x\n\n" % i for i in range(12))


def test_a_kept_alive_connection_the_engine_closes_on_reuse_is_retried_once_on_a_new_one() -> None:
    async def close_on_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 2:
            return False  # closes without answering: as an engine closing an idle keep-alive connection
        return await _two_events(reader, writer, n)

    async def main() -> None:
        fake = _Server(close_on_second)
        async with fake as url:
            pool = StreamPool(5.0, 30.0)
            assert (await _relayed(pool, url))[1] is None
            assert await _relayed(pool, url) == (b"data: a\n\ndata: b\n\n", None)
            assert fake.connections == 2
            await pool.close()

    asyncio.run(main())


def test_a_plain_answers_reused_connection_that_breaks_is_not_sent_again() -> None:
    """An engine sends nothing of a plain answer before it is whole: a reused connection that breaks before any byte
    may be the engine dying under a request it ran. The plain pool says so (the request is a suspect of the crash), and
    the request is not sent again; the stream pool's retry above is for streams alone."""

    async def close_on_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        return False if n == 2 else await _two_events(reader, writer, n)

    async def main() -> None:
        fake = _Server(close_on_second)
        async with fake as url:
            pool = StreamPool(5.0, 30.0, plain=True)
            first = await pool.request(url, "/v1/chat/completions", b"{}", {})
            assert first.content_type == "text/event-stream" and await first.read()
            first.release()
            with pytest.raises(UpstreamConnectionLost):
                await pool.request(url, "/v1/chat/completions", b"{}", {})
            assert fake.connections == 1  # not sent again on a new connection
            await pool.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("head", "sent", "expected"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n", b'{"ok": true}', b'{"ok": true}'),
        (b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n", b'{"a": 1}', b'{"a": 1}'),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 20\r\n\r\n", b'{"cut": "short"}', None),  # 16 of 20 bytes: lost
    ],
    ids=["unframed-1.1", "unframed-1.0", "length-cut-short"],
)
def test_a_plain_answer_without_length_or_chunks_ends_where_the_engine_closes(head: bytes, sent: bytes, expected: bytes | None) -> None:
    """An answer that declares neither its length nor chunks ends when the server closes the connection: read whole,
    as any HTTP client reads it, in pieces as they come; one that declared a length and closed short of it is lost."""

    async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(head + sent[:5])
        await writer.drain()
        await asyncio.sleep(0.05)  # the rest in a later read
        writer.write(sent[5:])
        await writer.drain()
        return False

    async def main() -> None:
        async with _Server(answer_then_close) as url:
            pool = StreamPool(5.0, 30.0, plain=True)
            exchange = await pool.request(url, "/v1/chat/completions", b"{}", {})
            if expected is None:
                with pytest.raises(UpstreamConnectionLost):
                    await exchange.read()
            else:
                assert await exchange.read() == expected
                assert exchange.content_type == "application/json" and not exchange.keep_alive
            exchange.release()
            await pool.close()

    asyncio.run(main())


def test_silence_after_the_headers_is_a_read_timeout_and_a_refused_connect_is_unreachable() -> None:
    async def main() -> None:
        async with _Server(lambda reader, writer, n: _head_then_silence(writer)) as url:
            pool = StreamPool(5.0, 0.3)
            started = time.monotonic()
            body, error = await _relayed(pool, url)
            assert body == b"" and isinstance(error, UpstreamReadTimeout), error
            assert 0.25 < time.monotonic() - started < 5
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.close()  # nothing listens there
        with pytest.raises(UpstreamUnreachable):
            await pool.request(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        assert pool.busy == 0

    asyncio.run(main())


def test_a_configured_cap_waits_for_a_free_connection_then_says_the_pool_is_full() -> None:
    async def main() -> None:
        async with _Server(lambda reader, writer, n: _head_then_silence(writer)) as url:
            pool = StreamPool(0.3, 30.0, max_connections=2)
            first = await pool.request(url, "/x", b"{}", {})
            second = await pool.request(url, "/x", b"{}", {})
            with pytest.raises(UpstreamPoolFull, match="2 upstream connections"):
                await pool.request(url, "/x", b"{}", {})
            waiting = asyncio.ensure_future(pool.request(url, "/x", b"{}", {}))
            await asyncio.sleep(0.05)
            first.close()  # a slot frees up: the waiting request takes it
            third = await waiting
            assert pool.busy == 2
            for exchange in (second, third):
                exchange.close()
            assert pool.busy == 0
            await pool.close()

    asyncio.run(main())


def test_a_connection_lost_mid_stream_ends_the_relay_with_the_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + b"9\r\ndata: a\n\n\r\n")
        await writer.drain()
        return False

    async def main() -> None:
        async with _Server(cut) as url:
            pool = StreamPool(5.0, 30.0)
            body, error = await _relayed(pool, url)
            assert body == b"data: a\n\n" and isinstance(error, UpstreamConnectionLost)
            assert pool.busy == 0
            await pool.close()

    asyncio.run(main())


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux-only")
def test_reused_stream_connections_acknowledge_reads_at_once() -> None:
    """Like the plain session's (tests/gateway/test_upstream_session.py): at each event of each stream on one
    reused connection, the kernel reports quick-ACK mode (set once per response, at its first read)."""

    async def main() -> list[list[int]]:
        server = await asyncio.start_server(_sse_server, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = StreamPool(5.0, 30.0)
        modes = []
        try:
            for _ in range(5):
                exchange = await pool.request(url, "/", b"", {})
                sock = exchange.connection.transport.get_extra_info("socket")
                seen: list[int] = []
                ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                exchange.relay(_ack_mode_into(seen, sock), _setter(ended))
                await ended
                modes.append(seen)
                exchange.release()
        finally:
            await pool.close()
            server.close()
        return modes

    assert asyncio.run(main()) == [[1, 1]] * 5


def _ack_mode_into(seen: list[int], sock: socket.socket):  # type: ignore[no-untyped-def]
    """A body callback that appends the connection's ACK mode (1: quick) as each piece arrives."""
    return lambda _: seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK))


def _end_into(future: asyncio.Future[BaseException | None]):  # type: ignore[no-untyped-def]
    """An end callback that completes ``future`` with the exchange's error (None: a complete response)."""
    return lambda error: future.done() or future.set_result(error)


def _setter(future: asyncio.Future[None]):  # type: ignore[no-untyped-def]
    """A callback that completes ``future`` the first time it is called."""
    return lambda *_: future.done() or future.set_result(None)
