"""The relay's byte scans in C (gateway/data/_relay_loop.c) give the answers of their Python definitions
(gateway.data.event_scan): where the first of several strings begins at or after a point, and a read's event count."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.errors import StreamKind
from gateway.data import _relay_loop, event_scan
from gateway.data.relay import _ENDINGS, _NEEDLES

_PARTS = st.sampled_from(
    [b'"usage":{', b'"usage": {', b'"usage":null', b'"error"', b'"error":{', b"data: [DONE]", b'data: {"error":', b"\n", b"\n\n",
     b'"', b"{", b"}", b"x", b" ", b"event: error", b'"type":"response.completed"']
)  # fmt: skip
_NEEDLE_SETS = st.sampled_from([*_NEEDLES.values(), *_ENDINGS.values(), (b"a",), (b"ab", b"b"), (b"\n",), (b"",), ()])


@settings(max_examples=500, deadline=None)
@given(parts=st.lists(_PARTS, max_size=16), needles=_NEEDLE_SETS, start=st.integers(min_value=-3, max_value=200))
def test_the_native_find_is_the_definitions(parts: list[bytes], needles: tuple[bytes, ...], start: int) -> None:
    data = b"".join(parts)
    assert _relay_loop.find_any(data, needles, start) == event_scan._find_any(data, needles, max(start, 0))


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=64) | st.lists(st.sampled_from([b"\n", b"\n\n", b"a", b"\r\n"]), max_size=30).map(b"".join))
def test_the_native_event_count_is_the_definitions(data: bytes) -> None:
    assert _relay_loop.count_events(data) == event_scan._count_events(data) == data.count(b"\n\n")


def test_the_relay_uses_the_native_scans_where_they_are_built() -> None:
    assert event_scan.NATIVE and event_scan.find_any is _relay_loop.find_any and event_scan.count_events is _relay_loop.count_events


def test_a_usage_object_is_found_and_the_null_every_chunk_carries_is_not() -> None:
    chunk = b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
    usage = b'data: {"choices":[],"usage": {"prompt_tokens":3}}\n\n'
    for find in (_relay_loop.find_any, event_scan._find_any):
        assert find(chunk * 3, _NEEDLES[StreamKind.DATA], 0) == -1
        assert find(chunk * 3 + usage, _NEEDLES[StreamKind.DATA], 0) == len(chunk) * 3 + usage.index(b'"usage"')


@pytest.mark.parametrize("bad", [("x", (b"a",), 0), (b"x", [b"a"], 0), (b"x", ("a",), 0), (b"x", (b"a",), "0")])
def test_the_native_find_refuses_what_is_not_bytes_a_tuple_and_an_int(bad: tuple[object, ...]) -> None:
    with pytest.raises(TypeError):
        _relay_loop.find_any(*bad)
