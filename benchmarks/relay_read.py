"""The relay's own Python per upstream read, timed alone: this checkout against another, in the same run.

At high batch the gateway's cost per streamed token is one read from the engine, the relay's Python, and one write
to the client. The paced benchmark measures all of it with the kernel and the machine's noise; this times only
the Python: a one-token chat event, HTTP-chunked as an engine sends it, fed to the upstream connection's
``data_received`` (the C parser, the relay's cut and scan, the chunked write) with a transport that drops what it
is given. Each checkout runs in a subprocess of its own (its ``PYTHONPATH``), in alternating rounds.

Run: ``python -m benchmarks.relay_read [--baseline <checkout>] [--reads 100000] [--rounds 4]``; prints ns per read
(the best batch of each round, then their median) and the ratio baseline / this checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_BATCHES = 7
# a token in the middle of a chat answer, as SGLang frames it (benchmarks.fake_upstream.stream_events)
_EVENT = (
    b'data: {"id":"chatcmpl-fake","object":"chat.completion.chunk","created":1796417000,"model":"bench","choices":'
    b'[{"index":0,"delta":{"role":"assistant","content":"tok "},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
)


class _DroppingTransport:
    """Takes writes and drops them: what is timed is the relay, not the socket."""

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        pass


class _NoLease:
    """What the relay asks of its lease while a stream runs (nothing to give back here)."""

    def __init__(self, upstream: Any) -> None:
        self.upstream = upstream
        self.request = None

    def release_grammar(self) -> None:
        pass

    def close(self) -> None:
        pass


async def _time_reads(reads: int) -> tuple[float, str]:
    """ns per one-event read through the relay of the checkout on ``sys.path`` (the best of a few batches), and
    the file of the relay measured."""
    import httptools

    from gateway.core.context import RequestInfo
    from gateway.core.errors import StreamKind
    from gateway.data import relay, stream_pool

    pool = stream_pool.StreamPool(5.0, 600.0)
    connection = stream_pool._Connection(pool, ("http", "engine", 80), quickack=False)
    connection.connection_made(_DroppingTransport())  # type: ignore[arg-type]
    exchange = stream_pool.StreamExchange(connection, 600.0)
    connection.exchange = exchange
    connection.parser = httptools.HttpResponseParser(connection)
    connection.parser.feed_data(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    info = RequestInfo("bench", "POST", "/v1/chat/completions")
    response = relay.SSEProxyResponse(_NoLease(exchange), info, None, "bench", StreamKind.DATA)  # type: ignore[arg-type]
    cycle = SimpleNamespace(disconnected=False, transport=_DroppingTransport(), chunked_encoding=True, flow=SimpleNamespace(write_paused=False))
    writer = relay._TransportWriter(cycle, exchange)
    response._writer = writer
    finishing = getattr(response, "_says_finishing", None)  # (older checkouts: the relay's return value said it)
    if finishing is None:
        exchange.relay(response._on_data, writer.finish)
    else:
        exchange.relay(response._on_data, writer.finish, finishing)
    chunk = b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)
    received = connection.data_received
    batches = []
    for _ in range(_BATCHES):
        started = time.perf_counter()
        for _ in range(reads):
            received(chunk)
        batches.append((time.perf_counter() - started) / reads * 1e9)
    exchange._stop_timer()
    assert response.events == reads * _BATCHES, response.events  # every event went through the relay
    return min(batches), str(relay.__file__)


def _measure(checkout: Path, reads: int) -> float:
    """One measurement in a subprocess whose ``gateway`` (and ``benchmarks``) are the checkout's; this file is run
    by path, so a checkout from before it existed can be measured."""
    run_this = f"import runpy, sys; sys.argv = ['relay_read', '--measure', '--reads', '{reads}']; runpy.run_path({str(Path(__file__))!r}, run_name='__main__')"
    done = subprocess.run(
        [sys.executable, "-c", run_this], cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"relay_read: the measurement of {checkout} failed:\n{done.stderr[-2000:]}")
    nanoseconds, measured = done.stdout.strip().splitlines()[-1].split(" ", 1)
    if not Path(measured).resolve().is_relative_to(checkout.resolve()):  # an installed gateway came first
        raise SystemExit(f"relay_read: {checkout} has no gateway of its own (measured {measured})")
    return float(nanoseconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay_read", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout (git worktree add /tmp/before <commit>)")
    parser.add_argument("--reads", type=int, default=100_000, help="reads per batch")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per checkout")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one subprocess' measurement
    args = parser.parse_args(argv)
    if args.measure:
        nanoseconds, measured = asyncio.run(_time_reads(args.reads))
        print(f"{nanoseconds:.1f} {measured}")
        return 0
    checkouts = {"this": REPO} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    rounds: dict[str, list[float]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, checkout in checkouts.items():
            rounds[name].append(_measure(checkout, args.reads))
    for name, values in rounds.items():
        print(f"{name:8s} ns per one-event read: median {statistics.median(values):7.0f}  rounds {' '.join(f'{v:.0f}' for v in values)}")
    if args.baseline:
        print(f"baseline / this: {statistics.median(rounds['baseline']) / statistics.median(rounds['this']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
