"""What the gateway takes out of a plain answer for the SDKs' models (gateway.data.answer_extensions), without an
engine: SGLang 0.5.23's metadata as it comes, and the header's values. The real engine's answers:
tests/gateway/test_sdk_schemas.py."""

from __future__ import annotations

from gateway.data.answer_extensions import drop_schema_breaking, keeps_extensions

SGLANG_METADATA = {"weight_version": "default", "weight_versions": [{"version": "default", "start": 0, "end": 8}]}


def test_only_the_metadata_entries_that_are_not_strings_go() -> None:
    answer = {"id": "x", "object": "chat.completion", "metadata": dict(SGLANG_METADATA), "usage": {"prompt_tokens": 3}}
    assert drop_schema_breaking(answer)
    assert answer == {"id": "x", "object": "chat.completion", "metadata": {"weight_version": "default"}, "usage": {"prompt_tokens": 3}}
    assert not drop_schema_breaking(answer)  # nothing left to take: the answer is not written again
    assert not drop_schema_breaking({"id": "x"}) and not drop_schema_breaking({"metadata": None})


def test_the_header_takes_keep_or_drop() -> None:
    assert keeps_extensions(None) is False
    assert keeps_extensions("keep") is True and keeps_extensions(" Keep ") is True
    assert keeps_extensions("drop") is False
    assert keeps_extensions("all") is None and keeps_extensions("") is None
