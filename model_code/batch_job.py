"""A batch job handed to the gateway's Files and Batches API (``batch_predict(..., via="batch")``): the job lives in
the gateway, not in the notebook's process, so a kernel restart loses nothing but the batch id (logged at submit).

Only HTTP through the ``openai`` SDK, at the model's URL with its key: ``model_code`` never imports ``gateway``.
This module moves JSONL lines in and out; :mod:`model_code.batch` turns them into results.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import openai
from loguru import logger
from openai.types import Batch

from model_code.errors import BadRequestError, from_openai_error
from model_code.guard import CHAT_PATH

ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
FIRST_POLL_S, LAST_POLL_S = 0.5, 10.0  # polls start fast (small jobs end in seconds) and slow down to one per 10 s
PROGRESS_EVERY_S = 60.0


@contextmanager
def _typed_errors(base_url: str) -> Iterator[None]:
    """The SDK's errors as :mod:`model_code.errors`; a 404 from the files or batches routes means no batch API there."""
    try:
        yield
    except openai.NotFoundError as error:
        code = getattr(error, "code", None)
        if code not in ("batch_not_found", "file_not_found"):
            raise BadRequestError(
                f"via='batch': {base_url} serves no batch API ({code or 'HTTP 404'}): it needs a gateway with "
                "gateway.batches enabled and a state_dir; use via='direct'",
                engine_status=404, body=error.body, code=code or "batches_off",
            ) from error
        raise from_openai_error(error) from error
    except openai.OpenAIError as error:
        raise from_openai_error(error) from error


def jsonl(bodies: list[dict[str, Any]]) -> bytes:
    """One batch request line per chat body, ``custom_id`` its index (the result's row)."""
    lines = ({"custom_id": str(index), "method": "POST", "url": CHAT_PATH, "body": body} for index, body in enumerate(bodies))
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def submit(api: openai.OpenAI, bodies: list[dict[str, Any]], metadata: dict[str, str]) -> str:
    """Upload ``bodies`` as one JSONL file and create its batch: the batch id (the gateway checks every line first)."""
    base_url = str(api.base_url)
    with _typed_errors(base_url):
        source = api.files.create(file=("batch_predict.jsonl", io.BytesIO(jsonl(bodies))), purpose="batch")
        batch = api.batches.create(
            input_file_id=source.id, endpoint=CHAT_PATH, completion_window="24h", metadata=metadata
        )
    return batch.id


def retrieve(api: openai.OpenAI, batch_id: str) -> Batch:
    with _typed_errors(str(api.base_url)):
        return api.batches.retrieve(batch_id)


def wait_ended(api: openai.OpenAI, batch_id: str, sleep: Callable[[float], None] = time.sleep) -> Batch:
    """The batch once it ended; polls every 0.5 s at first, then less often (up to every 10 s), a progress line a minute."""
    interval, logged = FIRST_POLL_S, time.monotonic()
    while (batch := retrieve(api, batch_id)).status not in ENDED:
        if time.monotonic() - logged >= PROGRESS_EVERY_S:
            logged = time.monotonic()
            counts = batch.request_counts
            done = f"{counts.completed + counts.failed}/{counts.total}" if counts else "?"
            logger.info("batch {}: {}, {} lines done", batch_id, batch.status, done)
        sleep(interval)
        interval = min(interval * 1.5, LAST_POLL_S)
    return batch


def file_lines(api: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """The JSON lines of a file of the batch (none for a file it does not have)."""
    if file_id is None:
        return []
    with _typed_errors(str(api.base_url)):
        text = api.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def result_lines(api: openai.OpenAI, batch: Batch) -> dict[str, dict[str, Any]]:
    """Every result line of an ended batch (output and errors), by ``custom_id``."""
    lines = file_lines(api, batch.output_file_id) + file_lines(api, batch.error_file_id)
    return {str(line["custom_id"]): line for line in lines}


def input_bodies(api: openai.OpenAI, batch: Batch) -> list[dict[str, Any]]:
    """The request bodies the batch was created with, in ``custom_id`` order (its prompts, after a kernel restart)."""
    lines = file_lines(api, batch.input_file_id)
    if not all(str(line.get("custom_id")).isdigit() for line in lines):
        raise BadRequestError(f"batch {batch.id} was not submitted by submit_batch (its custom_ids are not row indexes)")
    return [line["body"] for line in sorted(lines, key=lambda line: int(line["custom_id"]))]
