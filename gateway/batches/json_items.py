"""The items of one array in a JSON body, read as the body arrives: memory bounded by one item, not the body.

A Message Batches create is ``{"requests": [...]}`` of up to ``max_file_bytes`` (100 MB): parsed whole it held the body,
its Python objects and the event loop for tens of seconds. :func:`array_items` scans the body's bytes for the
boundaries of the array's items (strings and nesting followed; the regular expressions jump from one structural
character to the next, so a long string costs one search), and yields each item's bytes for the caller to parse and
check; an item over ``limit`` bytes is refused as soon as it passes the limit, and the caller may stop at any item
(too many) without the rest being read. The items themselves are parsed by the caller (orjson, pydantic).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

_STRUCTURE = re.compile(rb'["{}\[\]]')  # outside a string: what changes the nesting, or opens a string
_IN_STRING = re.compile(rb'["\\]')  # inside a string: its end, or an escape (whose next byte is skipped)
_SCALAR_END = re.compile(rb"[,\]}\s]")
_SPACE = b" \t\r\n"


class BodyError(ValueError):
    """The body is not the JSON asked for: ``where`` (a field path, named as pydantic names it) and why."""

    def __init__(self, where: str, message: str, code: str = "invalid_request") -> None:
        super().__init__(f"{where}: {message}")
        self.where, self.message, self.code = where, message, code


class _Buffer:
    """The body's bytes not yet used, read more at a time by ``read`` (b"": the end)."""

    def __init__(self, read: Callable[[], bytes]) -> None:
        self._read = read
        self.data = bytearray()
        self.pos = 0
        self._ended = False

    def more(self, keep: int) -> int:
        """Read more, dropping the bytes before ``keep`` first; how many were dropped (offsets move down by it), -1 at the end."""
        if self._ended:
            return -1
        chunk = self._read()
        if not chunk:
            self._ended = True
            return -1
        del self.data[:keep]
        self.pos -= keep
        self.data += chunk
        return keep

    def peek(self) -> bytes:
        """The next byte that is not white space (consumed up to it), b"" at the end of the body."""
        while True:
            while self.pos < len(self.data) and self.data[self.pos] in _SPACE:
                self.pos += 1
            if self.pos < len(self.data):
                return bytes(self.data[self.pos : self.pos + 1])
            if self.more(self.pos) < 0:
                return b""

    def value(self, limit: int, where: str) -> bytes:
        """The bytes of the JSON value at the next non-space byte (its end found, not parsed), at most ``limit``."""
        first = self.peek()
        if not first:
            raise BodyError(where, "not JSON: the body ends here")
        start = self.pos
        if first not in b'{["':  # a number, true, false, null (or not JSON): up to the next separator or space
            while (found := _SCALAR_END.search(self.data, start)) is None:
                if len(self.data) - start > limit:
                    raise BodyError(where, f"more than {limit} bytes", "line_too_large")
                dropped = self.more(start)
                if dropped < 0:
                    break
                start -= dropped
            return self._taken(start, found.start() if found is not None else len(self.data), limit, where)
        i, depth, in_string = start, 0, False
        while True:
            found = (_IN_STRING if in_string else _STRUCTURE).search(self.data, i)
            if found is not None and in_string and found[0] == b"\\" and found.end() >= len(self.data):
                i, found = found.start(), None  # an escape split between reads: from it again once more came
            elif found is not None:
                mark = found[0]
                i = found.end() + (1 if in_string and mark == b"\\" else 0)
                if in_string:
                    in_string = mark != b'"'
                elif mark == b'"':
                    in_string = True
                else:
                    depth += 1 if mark in b"{[" else -1
                if not in_string and depth <= 0:
                    return self._taken(start, i, limit, where)
                if i - start <= limit:
                    continue
            else:
                i = len(self.data)
            if i - start > limit:
                raise BodyError(where, f"more than {limit} bytes", "line_too_large")
            dropped = self.more(start)
            if dropped < 0:
                raise BodyError(where, "not JSON: the body ends inside it")
            start, i = start - dropped, i - dropped

    def _taken(self, start: int, end: int, limit: int, where: str) -> bytes:
        if end - start > limit:
            raise BodyError(where, f"more than {limit} bytes", "line_too_large")
        self.pos = end
        return bytes(self.data[start:end])


def array_items(read: Callable[[], bytes], key: str, limit: int) -> Iterator[bytes]:
    """The bytes of each item of the array ``key`` of the JSON object that is the whole body, in order, each at most
    ``limit`` bytes; :class:`BodyError` for a body of another shape (another key, not an array, not JSON)."""
    body = _Buffer(read)
    if body.peek() != b"{":
        raise BodyError("body", "Input should be a valid dictionary or object")
    body.pos += 1
    if body.peek() == b"}":
        raise BodyError(key, "Field required")
    given = False
    while True:
        name = _name(body)
        if name != key:
            raise BodyError(name, "Extra inputs are not permitted")
        if given:
            raise BodyError(key, "given twice")
        given = True
        if body.peek() != b"[":
            raise BodyError(key, "Input should be a valid list")
        body.pos += 1
        count = 0
        while not (count == 0 and body.peek() == b"]"):
            yield body.value(limit, f"{key}[{count}]")
            count += 1
            mark = body.peek()
            if mark == b"]":
                break
            if mark != b",":
                raise BodyError(f"{key}[{count - 1}]", "not JSON: ',' or ']' expected after it")
            body.pos += 1
        body.pos += 1
        if count == 0:
            raise BodyError(key, "List should have at least 1 item after validation, not 0")
        mark = body.peek()
        body.pos += 1
        if mark == b"}":
            break
        if mark != b",":
            raise BodyError("body", "not JSON: ',' or '}' expected")
    if body.peek():
        raise BodyError("body", "not JSON: more after the object")


def _name(body: _Buffer) -> str:
    """A key of the object and its colon."""
    import orjson  # (a key is a JSON string: escapes decoded as JSON decodes them)

    if body.peek() != b'"':
        raise BodyError("body", "not JSON: a key expected")
    raw = body.value(4096, "body")
    if body.peek() != b":":
        raise BodyError("body", "not JSON: ':' expected after a key")
    body.pos += 1
    try:
        return str(orjson.loads(raw))
    except orjson.JSONDecodeError:
        raise BodyError("body", "not JSON: a key that is not a string") from None
