"""The streamed reader of a Message Batches create's body (gateway/batches/json_items.py) agrees with a whole-body
JSON parser on every split of the body into reads, and refuses other shapes and oversized items as it reads."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.batches.json_items import BodyError, array_items

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _reads(data: bytes, sizes: list[int]) -> Callable[[], bytes]:
    """``data`` handed out in reads of ``sizes`` (cycled), as a request body arrives."""
    at, turn = 0, 0

    def read() -> bytes:
        nonlocal at, turn
        size = sizes[turn % len(sizes)] if sizes else len(data)
        turn += 1
        chunk = data[at : at + max(size, 1)]
        at += len(chunk)
        return chunk

    return read


def _items(data: bytes, sizes: list[int], limit: int = 1 << 20) -> list[Any]:
    """The items, each parsed as the whole body is (json: integers of any size stay integers, where orjson's 64 bits
    would make a float of -2**63 - 1 and the two parses disagree about a value the reader passed through intact)."""
    return [json.loads(item) for item in array_items(_reads(data, sizes), "requests", limit)]


@settings(max_examples=300, deadline=None)
@example(items=[-(2**63) - 1, 2**64], sizes=[], indent=False)  # integers wider than 64 bits pass through exactly
@given(items=st.lists(_json, min_size=1, max_size=6), sizes=st.lists(st.integers(1, 9), max_size=5), indent=st.booleans())
def test_the_items_are_those_a_whole_parse_finds_whatever_the_reads(items: list[Any], sizes: list[int], indent: bool) -> None:
    body = json.dumps({"requests": items}, indent=2 if indent else None, ensure_ascii=False).encode()
    assert _items(body, sizes) == json.loads(body)["requests"]


@pytest.mark.parametrize(
    ("body", "where", "words"),
    [
        (b'{"requests": [1], "other": 2}', "other", "Extra inputs"),
        (b'{"other": []}', "other", "Extra inputs"),
        (b"{}", "requests", "Field required"),
        (b'{"requests": {}}', "requests", "valid list"),
        (b'{"requests": []}', "requests", "at least 1 item"),
        (b"[1]", "body", "dictionary"),
        (b'{"requests": [{"a": "b"', "requests[0]", "ends inside"),
        (b'{"requests": [1 2]}', "requests[0]", "expected"),
        (b'{"requests": [1]} x', "body", "more after"),
    ],
)
def test_other_shapes_are_refused_naming_where(body: bytes, where: str, words: str) -> None:
    with pytest.raises(BodyError) as refused:
        _items(body, [3])
    assert refused.value.where == where and words in refused.value.message, refused.value


def test_an_item_over_the_limit_is_refused_before_it_is_read_whole() -> None:
    """An item of 10 MB with a limit of 1 KB: refused once about the limit was read, not at its end."""
    served = 0

    def chunks() -> Iterator[bytes]:
        nonlocal served
        yield b'{"requests": [{"x": "'
        while True:
            served += 4096
            yield b"a" * 4096

    source = chunks()
    with pytest.raises(BodyError) as refused:
        list(array_items(lambda: next(source), "requests", 1024))
    assert refused.value.code == "line_too_large" and refused.value.where == "requests[0]"
    assert served <= 8192
