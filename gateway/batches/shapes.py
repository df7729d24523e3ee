"""The batch API's wire objects, in OpenAI's shapes (what the ``openai`` SDK parses), and the create request."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.core.endpoints import CHAT_COMPLETIONS

ENDPOINTS = (CHAT_COMPLETIONS, "/v1/completions", "/v1/embeddings", "/v1/responses")
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
ACTIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
WINDOW_S = {"24h": 24 * 3600}


class BatchCreate(BaseModel):
    """``POST /v1/batches``'s body."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = Field(None, description="At most 16 pairs; keys up to 64 characters, values up to 512.")
    output_expires_after: dict[str, Any] | None = None  # accepted for the SDK's sake; files are kept until deleted

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("metadata: at most 16 pairs, keys up to 64 characters, values up to 512")
        return value


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class ListPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[Any]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class InputLine(BaseModel):
    """One line of an input file: OpenAI's request object (unknown fields refused, as on a live request)."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


def page(items: list[Any], has_more: bool) -> dict[str, Any]:
    """A list answer as OpenAI's cursor pages (``first_id``, ``last_id``, ``has_more``) are shaped."""
    ids = [item["id"] for item in items]
    return ListPage(data=items, first_id=ids[0] if ids else None, last_id=ids[-1] if ids else None, has_more=has_more).model_dump()
