"""An input file checked whole before a batch exists: every line parsed and put through the guard of a live request
of the batch's endpoint (allowlist, bounds, grammar inputs, the model among the key's, extension fields).

The first bad line answers 400 naming it (its number in the file and its custom_id), with the guard's own message:
a batch either starts with every line valid or is not created.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from pydantic import ValidationError

from engine_guard.token_ids import token_id_problem
from gateway.batches.files import FileStorage, jsonl_lines
from gateway.batches.shapes import InputLine
from gateway.config import BatchSettings
from gateway.core.endpoints import PROXIED_BY_PATH, ProxiedRoute
from gateway.core.errors import GatewayError
from gateway.core.state import GatewayState
from gateway.data.routes import guard_request
from gateway.tenants.keys import Tenant

STEP = 32  # lines checked between two pauses (about 2 ms of work)
STEP_PAUSE_S = 0.0005


def checked_lines(
    state: GatewayState, files: FileStorage, file_id: str, endpoint: str, tenant: Tenant | None, limits: BatchSettings
) -> list[str]:
    """The custom_ids of ``file_id``'s lines, in order, once every line passed; else GatewayError(400) naming the first bad one."""
    route = PROXIED_BY_PATH[endpoint]
    custom_ids: list[str] = []
    seen: set[str] = set()
    with files.open(file_id) as stream:
        for index, number, raw in jsonl_lines(stream):
            step_aside(index)
            if index >= limits.max_lines:
                raise _bad(number, None, f"the file has more than {limits.max_lines} requests (gateway.batches.max_lines)", "too_many_lines")
            if len(raw) > limits.max_line_bytes:
                raise _bad(number, None, f"{len(raw)} bytes, more than {limits.max_line_bytes} (gateway.batches.max_line_bytes)", "line_too_large")
            line = _parsed(number, raw)
            if line.custom_id in seen:
                raise _bad(number, line.custom_id, "custom_id is not unique in the file", "duplicate_custom_id")
            if line.url != endpoint:
                raise _bad(number, line.custom_id, f"url {line.url!r} is not the batch's endpoint {endpoint!r}", "mismatched_url")
            if line.body.get("stream"):
                raise _bad(number, line.custom_id, "a batch line cannot stream (stream: true)", "invalid_request")
            try:
                guarded(state, route, line.body, tenant)
            except GatewayError as error:
                raise _bad(number, line.custom_id, error.message, error.code, error.param) from None
            seen.add(line.custom_id)
            custom_ids.append(line.custom_id)
    if not custom_ids:
        raise GatewayError(400, f"input file {file_id!r} has no requests", code="empty_file", param="input_file_id")
    return custom_ids


def step_aside(index: int) -> None:
    """Every :data:`STEP` lines, let go of the GIL a moment: a check is pure Python, and two of them would otherwise
    hold the event loop off the interpreter for whole switch intervals at a time (other keys' calls wait)."""
    if index % STEP == STEP - 1:
        time.sleep(STEP_PAUSE_S)


def guarded(state: GatewayState, endpoint: ProxiedRoute, body: dict[str, Any], tenant: Tenant | None) -> None:
    """A live request's guard for one line's body, and its token ids against its model's vocabulary (what the
    request's admission checks when it runs: refused at the create instead of failing the line later)."""
    parsed, route, _ = guard_request(state, endpoint, orjson.dumps(body), tenant)
    problem = token_id_problem(endpoint.token_ids, parsed, route.backend.vocab_size)
    if problem is not None:
        raise GatewayError(400, problem, code="invalid_token_ids", param=problem.split(":", 1)[0])


def _parsed(number: int, raw: bytes) -> InputLine:
    try:
        data: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise _bad(number, None, f"not JSON ({error})", "invalid_json") from None
    try:
        return InputLine.model_validate(data)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"]) or "line"
        custom_id = data.get("custom_id") if isinstance(data, dict) and isinstance(data.get("custom_id"), str) else None
        raise _bad(number, custom_id, f"{where}: {problem['msg']}", "invalid_line") from None


def _bad(number: int, custom_id: str | None, message: str, code: str, param: str | None = None) -> GatewayError:
    who = f" (custom_id {custom_id!r})" if custom_id is not None else ""
    field = f" [{param}]" if param else ""
    return GatewayError(400, f"input file line {number}{who}{field}: {message}", code=code, param="input_file_id")
