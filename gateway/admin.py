"""The admin API (``/admin/...``, admin key only; see ``auth``): inspect, reload, swap and drain models.

Reload and swap answer when the work is done (an engine start can take minutes: use a long client
timeout). A reload whose file is invalid answers 400 naming file, key and reason; one in which a
model's new engine failed answers 502 with the engine's log tail, the old engine still serving.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.config import SwapPolicy
from gateway.control import Controller, ReloadInvalid
from gateway.errors import GatewayError, error_body

router = APIRouter(prefix="/admin", include_in_schema=False)  # not listed in /openapi.json to client keys


def _controller(request: Request) -> Controller:
    return request.app.state.controller


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


@router.get("/models")
async def models(request: Request) -> Response:
    return _json(_controller(request).describe())


@router.post("/reload")
async def reload(request: Request) -> Response:
    try:
        report = await _controller(request).reload("admin")
    except ReloadInvalid as error:
        raise GatewayError(400, f"invalid config, nothing changed: {error}", code="invalid_config") from None
    if report["ok"]:
        return _json(report)
    message = "; ".join(f"model {name}: {report['models'][name].get('error')}" for name in report["failed"])
    return _json({**error_body(f"reload applied partly: {message}", "upstream_error", "engine_start_failed"), "reload": report}, 502)


@router.post("/models/{name}/swap")
async def swap(name: str, request: Request, policy: SwapPolicy | None = None) -> Response:
    """Restart the model's engine with its current config (blue-green unless ``policy=stop-first``)."""
    result = await _controller(request).swap(name, policy)
    if result.ok:
        return _json({"ok": True, **result.as_dict()})
    body = error_body(f"swap of model {name!r} failed: {result.error}", "upstream_error", "engine_start_failed")
    return _json({**body, "swap": result.as_dict()}, 502)


@router.post("/models/{name}/drain")
async def drain(name: str, request: Request, wait: bool = False) -> Response:
    """Stop admitting requests for the model (503 + Retry-After); ``wait=true`` waits for in-flight ones."""
    controller = _controller(request)
    route = controller.set_drained(name, True)
    idle = await controller.wait_idle(route, controller.state.settings.drain_timeout_s) if wait else None
    return _json({"model": route.name, "drained": True, "in_flight": route.backend.in_flight, **({"idle": idle} if wait else {})})


@router.post("/models/{name}/undrain")
async def undrain(name: str, request: Request) -> Response:
    route = _controller(request).set_drained(name, False)
    return _json({"model": route.name, "drained": False, "in_flight": route.backend.in_flight})
