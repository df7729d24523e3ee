"""SGLang's extension fields that break the official SDKs' response models, taken out of a plain answer.

SGLang puts ``"metadata": {"weight_version": "default", "weight_versions": [{"version", "start", "end"}]}`` in
every plain chat and text completion. OpenAI's schema types a response's ``metadata`` as a map of strings
(``openai.types.shared.Metadata``): an SDK that declares the field (``ChatCompletion`` from openai 3) fails to
validate the answer (pydantic-ai's chat model validates every one), and the openai SDK warns when it dumps one.
Entries that are not strings are dropped; the strings (``weight_version``) stay, where the schema allows them.
A client that wants the answer as the engine wrote it asks with :data:`HEADER` (docs/serving.md, SGLang
extensions in answers).

The other fields SGLang adds (``matched_stop``, ``reasoning_content``, ``usage.reasoning_tokens``, ``sglext``...)
are extra keys the SDKs' models accept and keep as they are: they stay. Streamed chunks carry no ``metadata`` and
go out untouched.
"""

from __future__ import annotations

from typing import Any

HEADER = "x-sglang-extensions"  # "keep": the answer as the engine wrote it; "drop" (the default): as the SDKs read it
KEEP, DROP = "keep", "drop"


def keeps_extensions(value: str | None) -> bool | None:
    """Whether a request's :data:`HEADER` asks for the engine's answer untouched; None: a value it does not take."""
    if value is None:
        return False
    value = value.strip().lower()
    return True if value == KEEP else False if value == DROP else None


def drop_schema_breaking(data: dict[str, Any]) -> bool:
    """Take out of ``data`` (a plain chat or text completion, parsed) what its SDK's model refuses; whether
    anything was taken (the answer is then written again)."""
    metadata = data.get("metadata")
    if not isinstance(metadata, dict):
        return False
    breaking = [key for key, value in metadata.items() if not isinstance(value, str)]
    for key in breaking:
        del metadata[key]
    return bool(breaking)
