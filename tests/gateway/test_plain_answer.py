"""A plain answer's response is Starlette's, header for header: the same length and type (a ``text/`` type with
Starlette's charset unless it names one), for the types engines answer with."""

from __future__ import annotations

import pytest
from starlette.responses import Response

from gateway.data.answer import PlainAnswer


@pytest.mark.parametrize(
    "media_type", ["application/json", "application/json; charset=utf-8", "text/plain", "text/plain; charset=latin-1", "text/html; Charset=x"]
)
@pytest.mark.parametrize("content", [b"", b'{"id": "x"}', "é".encode() * 300])
def test_a_plain_answer_has_starlettes_headers_and_body(media_type: str, content: bytes) -> None:
    ours, starlettes = PlainAnswer(content, media_type), Response(content, status_code=200, media_type=media_type)
    assert ours.raw_headers == starlettes.raw_headers
    assert (ours.status_code, ours.body, ours.media_type, ours.background) == (200, starlettes.body, starlettes.media_type, None)
