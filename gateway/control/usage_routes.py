"""``GET /admin/usage``: totals from the usage ledger, by key, model and day (admin key only, like every ``/admin`` route).

It reads the database, so with worker processes (``/admin/*`` forwarded to the control process) a request's
row is there within ``gateway.usage.flush_interval_s`` of its end, whichever worker served it.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from loguru import logger
from starlette.responses import Response

from gateway.core.errors import GatewayError
from gateway.core.state import GatewayState
from gateway.tenants.ledger_schema import SchemaError
from gateway.tenants.usage_query import BadParameter, parse_query

usage_routes = APIRouter(prefix="/admin", include_in_schema=False)
PARAMS = ("key", "model", "since", "until", "group_by")


@usage_routes.get("/usage")
async def usage(request: Request) -> Response:
    """Requests, prompt / completion / cached tokens and errors; ``key``, ``model``, ``since`` / ``until`` (ISO 8601
    or unix seconds; since inclusive, until exclusive) filter, ``group_by`` is a comma list of key, model, day."""
    params = request.query_params
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise GatewayError(400, f"unknown parameter {unknown[0]!r} (known: {', '.join(PARAMS)})", code="invalid_parameter", param=unknown[0])
    try:
        query = parse_query(*(params.get(name) for name in PARAMS))
    except BadParameter as error:
        raise GatewayError(400, f"invalid {error.param}: {error.message}", code="invalid_parameter", param=error.param) from None
    state: GatewayState = request.app.state.gateway
    if state.ledger is None:
        raise GatewayError(503, "the usage ledger is off", code="usage_unavailable")
    try:
        rows = await state.ledger.read(query)
    except SchemaError as error:
        raise GatewayError(503, f"usage database: {error}", code="usage_unavailable") from None
    except Exception as error:  # the database is down or unreadable: say so, without a trace
        logger.warning("admin usage: cannot read the usage database: {}: {}", type(error).__name__, str(error).splitlines()[0][:300] if str(error) else "")
        raise GatewayError(503, f"the usage database cannot be read now ({type(error).__name__})", code="usage_unavailable") from None
    if rows is None:
        raise GatewayError(503, "no usage database: set gateway.state_dir or gateway.usage.database_url", code="usage_unavailable")
    return Response(orjson.dumps({"filters": query.filters(), "rows": rows}), media_type="application/json")
