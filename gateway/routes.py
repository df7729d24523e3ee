"""The HTTP routes: OpenAI endpoints (proxied), model listing, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import traceback
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from fastapi import APIRouter, Request
from loguru import logger
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.config import GatewaySettings
from gateway.context import RequestInfo, request_info
from gateway.errors import GatewayError, error_body, error_response
from gateway.metrics import Metrics
from gateway.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, _Loose, parse_body
from gateway.proxy import Proxy
from gateway.registry import Backend, ModelRoute, Registry

router = APIRouter()


@dataclass
class GatewayState:
    """Everything the routes need, stored on ``app.state.gateway`` (no module globals)."""

    settings: GatewaySettings
    registry: Registry
    metrics: Metrics
    proxy: Proxy | None = None  # set by the lifespan (it owns the HTTP client)


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def _proxied(request: Request, schema: type[_Loose], path: str) -> Response:
    state = _state(request)
    info: RequestInfo = request_info(request.scope) or RequestInfo("-", request.method, path)
    body = parse_body(await request.body(), schema)
    route = state.registry.resolve(body["model"])
    if route is None:
        raise GatewayError(
            404, f"The model {body['model']!r} does not exist; see GET /v1/models", code="model_not_found", param="model"
        )
    info.model = route.name
    info.stream = body.get("stream") is True
    assert state.proxy is not None, "the app's lifespan did not run"
    return await state.proxy.forward(route, body, path, info, request.receive)


# The proxied routes. The app serves them through :func:`proxied_endpoint`, plain ASGI ahead of
# FastAPI's routing (see ``gateway.app.GatewayAPI``); the FastAPI routes below stay as the same
# handlers for anything that reaches the router (an app without the fast path, the route list).
PROXIED_PATHS: dict[str, type[_Loose]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}


async def proxied_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    """POST of a proxied path as plain ASGI: the same handler and errors as the FastAPI routes, without
    their router, dependency machinery and per-message ``send`` wrappers (scope["app"] must be set)."""
    request = Request(scope, receive)
    path = scope["path"]
    try:
        response = await _proxied(request, PROXIED_PATHS[path], path)
    except GatewayError as error:
        note_error(scope, error.message)
        response = error_response(error)
    except Exception as error:  # noqa: BLE001 - every failure leaves as OpenAI-shaped JSON
        response = unexpected_error_response(scope, error)
    await response(scope, receive, send)


def note_error(scope: Scope, message: str) -> None:
    """Keep a short reason for the request's log line (the first one wins)."""
    info = request_info(scope)
    if info is not None and info.error is None:
        info.error = message[:200]


def unexpected_error_response(scope: Scope, error: BaseException) -> Response:
    """Log an unexpected error with its traceback and request id; answer a bare 500."""
    info = request_info(scope)
    trace = "".join(traceback.format_exception(error))
    logger.error("unhandled error in request {}: {}", info.request_id if info else "-", trace)
    return error_response(GatewayError(500, "internal gateway error", code="internal_error"))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _proxied(request, ChatCompletionRequest, "/v1/chat/completions")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _proxied(request, CompletionRequest, "/v1/completions")


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    return await _proxied(request, EmbeddingRequest, "/v1/embeddings")


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    await _fill_context_lengths(state)
    data = [card for route in state.registry.routes() for card in _cards(route, state)]
    return _json({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    state = _state(request)
    route = state.registry.resolve(model_id)
    if route is None:
        raise GatewayError(404, f"The model {model_id!r} does not exist", code="model_not_found", param="model")
    await _fill_context_lengths(state, [route.backend])
    return _json(next(card for card in _cards(route, state) if card["id"] == model_id))


@router.get("/health")
async def health() -> Response:
    """Liveness: the gateway process answers (engines are /ready's business)."""
    return _json({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    """200 only when every model has a healthy backend; 503 naming the ones that are not."""
    state = _state(request)
    routes = state.registry.routes()
    reasons = await asyncio.gather(*(_probe(state, route.backend) for route in routes))
    models = {route.name: {"ready": reason is None, **({"reason": reason} if reason else {})} for route, reason in zip(routes, reasons, strict=True)}
    down = [f"{name} ({m['reason']})" for name, m in models.items() if not m["ready"]]
    if down:
        body = error_body("not ready: " + ", ".join(down), "service_unavailable", "not_ready")
        return _json({**body, "status": "not_ready", "models": models}, 503)
    return _json({"status": "ready", "models": models})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text; ``gateway_engine_up`` of url models is their ``/health`` now (probed here)."""
    state = _state(request)
    await asyncio.gather(*(_probe(state, route.backend) for route in state.registry.routes() if not route.backend.managed))
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _probe(state: GatewayState, backend: Backend) -> str | None:
    """Why ``backend`` is not ready, or None; also remembers the result for the engine-up metric."""
    reason = backend.unavailable_reason()
    if reason is None and state.proxy is not None:
        try:
            response = await state.proxy.client.get(
                backend.url + "/health", headers=backend.upstream_headers(), timeout=state.settings.health_timeout_s
            )
            reason = None if response.status_code == 200 else f"/health answered {response.status_code}"
        except httpx.HTTPError as error:
            reason = f"/health failed: {type(error).__name__}"
    backend.last_health = reason is None
    return reason


async def _fill_context_lengths(state: GatewayState, backends: list[Backend] | None = None) -> None:
    """Ask each backend once for its context length (SGLang's ``max_model_len``); failures are retried later."""
    missing = [b for b in (backends or state.registry.backends()) if b.context_length is None and b.unavailable_reason() is None]
    if missing and state.proxy is not None:
        await asyncio.gather(*(_context_length(state, backend) for backend in missing))


async def _context_length(state: GatewayState, backend: Backend) -> None:
    assert state.proxy is not None
    try:
        response = await state.proxy.client.get(
            backend.url + "/v1/models", headers=backend.upstream_headers(), timeout=state.settings.health_timeout_s
        )
        cards = response.json().get("data", []) if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return
    for card in cards:
        if isinstance(card, dict) and isinstance(card.get("max_model_len"), int):
            if card.get("id") == backend.served_name or len(cards) == 1:
                backend.context_length = card["max_model_len"]
                return


def _cards(route: ModelRoute, state: GatewayState) -> list[dict[str, Any]]:
    backend = route.backend
    return [
        {
            "id": name,
            "object": "model",
            "created": int(backend.created_at),
            "owned_by": "sglang-gateway",
            "root": route.name,
            "parent": None if name == route.name else route.name,
            "max_model_len": backend.context_length,
            "context_length": backend.context_length,
        }
        for name in route.names
    ]
