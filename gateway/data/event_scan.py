"""Byte scans of an SSE read: where the first of some literal strings begins, and how many events it holds.

The relay scans each read it relays for a usage object or an error, counts its events, and looks for the stream's
ending in its last ones. In Python (``re``, ``bytes.count``) those three cost ~11 µs for a 16-token answer, most
of it the count (``bytes.count`` of a two-byte string runs a general search) and the scan (``re`` stops at every
quote, and JSON is mostly quotes). The native relay's extension (``_relay_loop.c``) does the same with ``memmem`` and
``memchr`` in ~2 µs; where it is not built, the Python definitions below serve. Both give the same answers
(``tests/gateway/test_event_scan.py``).
"""

from __future__ import annotations

import functools
import re

__all__ = ["NATIVE", "count_events", "find_any"]


@functools.cache
def _pattern(needles: tuple[bytes, ...]) -> re.Pattern[bytes]:
    return re.compile(b"|".join(re.escape(needle) for needle in needles))


def _find_any(data: bytes, needles: tuple[bytes, ...], start: int) -> int:
    """The lowest index at or after ``start`` where one of ``needles`` begins in ``data``; -1: none."""
    found = _pattern(needles).search(data, start) if needles else None  # (none: nothing to find, not the empty string)
    return -1 if found is None else found.start()


def _count_events(data: bytes) -> int:
    """The events ``data`` holds whole: its blank lines."""
    return data.count(b"\n\n")


try:
    from gateway.data._relay_loop import count_events, find_any
except ImportError:  # not built (or built before these): the Python definitions
    NATIVE = False
    count_events, find_any = _count_events, _find_any
else:
    NATIVE = True
