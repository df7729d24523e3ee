"""A batch's output and error files, from its lines' recorded ends, in OpenAI's line shape.

Output: every line answered 200, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}``.
Errors: every other line, with its answer when it got one (``response`` set, ``error`` from the answer's error), else
``response: null`` and the gateway's error (``batch_expired``, ``batch_cancelled``, or why no answer came). Both in input
order, so each custom_id is in exactly one of the two files.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson


def result_files(batch_id: str, lines: list[dict[str, Any]]) -> tuple[bytes, bytes]:
    """(output JSONL, error JSONL) of ``lines`` (:meth:`gateway.batches.store.BatchStore.ended_lines`)."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for line in lines:
        item = result_line(batch_id, line)
        (output if line["state"] == "done" and line["status_code"] == 200 else errors).append(orjson.dumps(item))
    return _jsonl(output), _jsonl(errors)


def result_line(batch_id: str, line: dict[str, Any]) -> dict[str, Any]:
    result = json.loads(line["result"]) if line.get("result") else None
    item: dict[str, Any] = {"id": _line_id(batch_id, line["line"]), "custom_id": line["custom_id"], "response": None, "error": None}
    if line["state"] == "done":
        item["response"] = {"status_code": line["status_code"], "request_id": line["request_id"], "body": result}
        if line["status_code"] != 200:
            error = result.get("error") if isinstance(result, dict) else None
            item["error"] = {
                "code": (error or {}).get("code") or str(line["status_code"]),
                "message": (error or {}).get("message") if isinstance(error, dict) else None,
            }
    else:
        item["error"] = result or {"code": line["state"], "message": None}
    return item


def _line_id(batch_id: str, line: int) -> str:
    return "batch_req_" + hashlib.blake2b(f"{batch_id}:{line}".encode(), digest_size=12).hexdigest()


def _jsonl(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)
