"""One chunk-framing contract for both relays: the native relay's parser (``_relay_loop.feed_chunks``) against
llhttp through httptools, the parser the Python relay reads engine responses with (gateway.data.stream_pool).

A differential property test: chunked bodies built from valid and hostile parts (sizes with leading zeros or past
64 bits, whitespace, extensions, trailers, bare CR or LF, bytes flipped, inserted or dropped), fed in random
pieces to both; the data each hands on and whether the body ended, went on or broke must be the same. The suite runs
a few hundred examples; ``CHUNK_FRAMING_EXAMPLES=100000`` runs the long one (docs/serving.md).
"""

from __future__ import annotations

import os

import httptools
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.data import _relay_loop

EXAMPLES = int(os.environ.get("CHUNK_FRAMING_EXAMPLES", "300"))
HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Body:
    """httptools' callbacks: the body's data until it ended (what the Python relay is handed)."""

    def __init__(self) -> None:
        self.data = b""
        self.ended = False

    def on_body(self, body: bytes) -> None:
        if not self.ended:
            self.data += body

    def on_message_complete(self) -> None:
        self.ended = True


def llhttp_chunks(pieces: list[bytes]) -> tuple[bytes, int]:
    """What llhttp makes of a chunked body fed in ``pieces``: its data, and 1 ended / 0 not yet / -1 broken (bytes
    after the end are not the body's: the end counts)."""
    body = _Body()
    parser = httptools.HttpResponseParser(body)
    parser.feed_data(HEAD)
    try:
        for piece in pieces:
            parser.feed_data(piece)
            if body.ended:
                break
    except httptools.HttpParserError:
        return body.data, 1 if body.ended else -1
    return body.data, 1 if body.ended else 0


_LINE_ENDS = st.sampled_from([b"\r\n"] * 60 + [b"\n", b"\r", b"", b" \r\n", b"\t\r\n", b"\r\r\n", b"\n\r\n"])
_EXTENSIONS = st.sampled_from(
    [b""] * 60 + [b";a", b";a=b", b";a", b";a=b", b';a="b c"', b";a=b;c=d", b';a="\\""', b";", b"; a", b";a =b", b";a= b", b";a\nb",
     b";a=\x80", b';a="x', b" ", b"\t", b" ;a", b";a=b ", b";\x00", b';a="\x7f"', b";a=b\rc"]
)  # fmt: skip
_TRAILERS = st.sampled_from(
    [b"x-t: 1", b"x-t:", b"X:  a  ", b"bad line", b"content-length: 5", b"transfer-encoding: chunked", b"connection: close",
     b"upgrade: x", b"x: a\x7f", b"x: a\x80", b"x: a\x01", b":x", b" x: y", b"x\t: 1", b"x: y\n", b"x: \"q\""]
)  # fmt: skip
_DIGITS = st.sampled_from(["%x", "%X", "%02x", "%016x", "%017x", "%020X", "%040x"])


@st.composite
def _chunk(draw: st.DrawFn) -> bytes:
    data = draw(st.binary(max_size=24))
    size = len(data) + draw(st.sampled_from([0] * 60 + [-1, 1, 2]))
    if draw(st.integers(0, 60)) == 0:
        size = draw(st.sampled_from([2**64 - 1, 2**64, 2**63, 16**15, 16**16]))
    size_text = (draw(_DIGITS) % max(size, 0)).encode() if size >= 0 else b""
    return size_text + draw(_EXTENSIONS) + draw(_LINE_ENDS) + data + draw(_LINE_ENDS)


@st.composite
def _framed(draw: st.DrawFn) -> bytes:
    """A chunked body: chunks, the last chunk, trailers, its end, maybe bytes after; then a few bytes mutated."""
    framed = b"".join(draw(st.lists(_chunk(), max_size=5)))
    if draw(st.integers(0, 3)):
        framed += b"0" * draw(st.integers(1, 20)) + draw(_EXTENSIONS) + draw(_LINE_ENDS)
        for trailer in draw(st.lists(_TRAILERS, max_size=2)) if draw(st.integers(0, 3)) == 0 else []:
            framed += trailer + draw(_LINE_ENDS)
        framed += draw(_LINE_ENDS) + draw(st.sampled_from([b"", b"", b"x", b"HTTP/1.1 200 OK\r\n"]))
    mutations = st.lists(st.tuples(st.integers(0, 400), st.sampled_from("ird"), st.binary(min_size=1, max_size=1)), max_size=2)
    for at, op, byte in draw(mutations) if draw(st.integers(0, 2)) == 0 else []:
        at = at % (len(framed) + 1)
        framed = framed[:at] + (byte if op != "d" else b"") + framed[at + (op != "i") :]
    return framed


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(framed=st.one_of(_framed(), _framed(), _framed(), st.binary(max_size=80)), cuts=st.lists(st.integers(0, 600), max_size=6))
def test_the_native_chunk_parser_answers_as_llhttp_does(framed: bytes, cuts: list[int]) -> None:
    points = sorted({0, *(cut for cut in cuts if cut < len(framed)), len(framed)})
    pieces = [framed[a:b] for a, b in zip(points, points[1:], strict=False)]
    expected = llhttp_chunks(pieces)
    event({1: "ended", 0: "goes on", -1: "broken"}[expected[1]])  # (--hypothesis-show-statistics: the mix of cases)
    assert _relay_loop.feed_chunks(pieces) == expected, framed


@pytest.mark.parametrize(
    ("framed", "expected"),
    [
        (b"0000000000000000005\r\nhello\r\n0\r\n\r\n", (b"hello", 1)),  # 19 hex digits: leading zeros are legal
        (b"ffffffffffffffff\r\nab", (b"ab", 0)),  # the largest size there is: a body that goes on
        (b"10000000000000000\r\nab", (b"", -1)),  # past 64 bits
        (b"5 \r\nhello\r\n", (b"", -1)),  # whitespace after the size
        (b"5;a\nb\r\nhello\r\n", (b"", -1)),  # a bare LF in an extension
        (b"5\r\nhello\r\n0\r\nx-t: 1\n\r\n", (b"hello", -1)),  # a bare LF in a trailer line
        (b"5\r\nhello\r\n0;a=\"b c\"\r\nx-t: 1\r\n\r\n", (b"hello", 1)),  # a quoted extension and a trailer: valid
        (b"5\r\nhello\r\n0\r\n\r\nHTTP/1.1", (b"hello", 1)),  # what follows the end is not the body's
    ],
    ids=["leading-zeros", "largest-size", "size-overflow", "space-after-size", "lf-in-extension", "lf-in-trailer", "valid-extras", "after-the-end"],
)  # fmt: skip
def test_the_framing_cases_the_relays_differed_on(framed: bytes, expected: tuple[bytes, int]) -> None:
    assert llhttp_chunks([framed]) == expected
    assert _relay_loop.feed_chunks([framed]) == expected
    assert _relay_loop.feed_chunks([framed[i : i + 1] for i in range(len(framed))]) == expected  # a byte per read
