"""The HTTP routes: every proxied model route (from :mod:`gateway.core.endpoints`), stored responses by id,
model listing, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import traceback
from typing import Any
from urllib.parse import quote

import orjson
from fastapi import APIRouter, FastAPI, Request
from loguru import logger
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine_guard.bounds import check_bounds
from engine_guard.refusal import Refused
from engine_guard.schemas import check_extensions, parse_body
from gateway.core.backends import Backend
from gateway.core.call import Call
from gateway.core.context import RequestInfo, request_info
from gateway.core.endpoints import PROXIED, RESPONSE_BY_ID, RESPONSE_CANCEL, ModelChoice, ProxiedRoute
from gateway.core.errors import Dialect, GatewayError, error_body, error_response, refused, shaped_for, unknown_model
from gateway.core.headers import header_map, header_text
from gateway.core.health import HealthProbes
from gateway.core.metrics_scope import scoped_exposition
from gateway.core.registry import ModelRoute
from gateway.core.responses_index import StoredResponse
from gateway.core.shared_store import StoreUnavailable
from gateway.core.state import GatewayState
from gateway.data.answer_extensions import DROP, KEEP, keeps_extensions
from gateway.data.answer_extensions import HEADER as EXTENSIONS_HEADER
from gateway.edge.auth import OPEN_OWNER, request_owner
from gateway.edge.cycle import HTTP_CYCLE
from gateway.tenants.keys import TENANT_SCOPE_KEY, Tenant
from gateway.tenants.priority import request_priority

api_routes = APIRouter()  # a FastAPI router (not SGLang's router): the data plane's routes
RESPONSE_ID_PREFIX = "resp_"  # SGLang refuses (400) a stored-response id without it

_EXTENSIONS_NAME = EXTENSIONS_HEADER.encode()


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _probes(state: GatewayState) -> HealthProbes:
    assert state.probes is not None, "the app's lifespan did not run"
    return state.probes


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def _proxied(request: Request, endpoint: ProxiedRoute) -> Response:
    """A proxied route's request: guarded, resolved into one :class:`Call`, forwarded."""
    state = _state(request)
    info: RequestInfo = request_info(request.scope) or RequestInfo("-", request.method, endpoint.path)
    tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
    priority = request_priority(request.scope, tenant)  # a proxied route is never an open path: None is no client keys
    cycle = request.scope.get("extensions", {}).get(HTTP_CYCLE)
    raw = await _body(request, cycle)
    body, route, grammar_size = guard_request(state, endpoint, raw, tenant, info)
    owner = request_owner(request.scope)
    pinned = await _continued_response(state, body, route, owner) if endpoint.response_ids else None
    keep_extensions = keeps_extensions(header_text(request.scope, _EXTENSIONS_NAME))
    if keep_extensions is None:
        raise GatewayError(
            400, f"the header {EXTENSIONS_HEADER} takes {KEEP!r} or {DROP!r}", code="invalid_header", param=EXTENSIONS_HEADER
        )
    call = Call(
        route, endpoint, body, info, owner, info.key_name or (None if owner == OPEN_OWNER else owner), request.receive,
        balancing=state.settings.balancing_for(route.name),
        pinned=pinned,
        grammar_size=grammar_size,
        priority=priority,
        keep_extensions=keep_extensions,
        cycle=cycle,
    )  # fmt: skip
    assert state.proxy is not None, "the app's lifespan did not run"
    return await state.proxy.forward(call)


async def _body(request: Request, cycle: Any = None) -> bytes:
    """``await request.body()`` without Starlette's async generator (registered with the loop and closed per
    request): the body's messages read in a loop, kept on the request as Starlette keeps it; under the gateway's
    protocol, a body already whole is taken from its ``cycle`` at once (:meth:`GatewayCycle.whole_body`)."""
    # (only a body of declared length: the body-size layer held that to its cap; a chunked one is counted as it is read)
    whole = cycle.whole_body() if cycle is not None and b"content-length" in header_map(request.scope) else None
    if whole is not None:
        request._body = whole
        return whole
    receive = request.receive
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        if piece := message.get("body", b""):
            chunks.append(piece)
        if not message.get("more_body", False):
            break
    raw = request._body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return raw


def guard_request(
    state: GatewayState, endpoint: ProxiedRoute, raw: bytes, tenant: Tenant | None, info: RequestInfo | None = None
) -> tuple[dict[str, Any], ModelRoute, int]:
    """The request guard of a live request (and of each batch line, checked at the batch's creation): the body parsed
    against the route's allowlist, its bounds and grammar inputs (engine_guard), its model among the key's, its
    extension fields allowed for that model. (body, model route, grammar bytes), or the GatewayError a client gets."""
    path = endpoint.upstream_path
    try:  # the request guard (engine_guard): the allowlist, its types and bounds, grammar inputs
        body = parse_body(raw, endpoint.schema, path)
        grammar_size = check_bounds(path, body, state.settings.request_bounds)
    except Refused as refusal:
        raise refused(refusal) from None
    route = _model_route(state, body, endpoint, tenant)
    if info is not None:
        info.model = route.name  # an adapter's name, "<model>:<adapter>", is set by the proxy that selects it
    try:
        check_extensions(body, path, state.settings.extensions_for(route.name), route.name)
    except Refused as refusal:
        raise refused(refusal) from None
    return body, route, grammar_size


def _model_route(state: GatewayState, body: dict[str, Any], endpoint: ProxiedRoute, tenant: Tenant | None = None) -> ModelRoute:
    """The model named in the body (or the default model, where the route lets the name be left out); a model the
    caller's key may not use answers as if it did not exist (404: other tenants' models stay unknown to it)."""
    route = _named_route(state, body, endpoint)
    if not _may_use(tenant, route):
        raise unknown_model(body.get("model") or "default")
    return route


def _may_use(tenant: Tenant | None, route: ModelRoute) -> bool:
    """Whether the caller's key may use (and so see) ``route``: every model for plain keys and open gateways."""
    return tenant is None or tenant.models is None or tenant.may_use(route.names)  # names: built only when asked


def _named_route(state: GatewayState, body: dict[str, Any], endpoint: ProxiedRoute) -> ModelRoute:
    name = body.get("model")
    if endpoint.model is ModelChoice.DEFAULT or (name is None and endpoint.model is ModelChoice.BODY_OR_DEFAULT):
        route = state.registry.default_route()
        if route is None:
            count = len(state.registry.routes())
            raise GatewayError(
                404, f"{endpoint.path} serves the default model, and none of the {count} models is aliased 'default'",
                code="model_not_found", param="model",
            )  # fmt: skip
        return route
    route = state.registry.resolve(name)
    if route is None:
        raise unknown_model(name)
    return route


async def _continued_response(state: GatewayState, body: dict[str, Any], route: ModelRoute, owner: str) -> Backend | None:
    """The backend holding ``previous_response_id``'s state: the request must go there."""
    previous = body.get("previous_response_id")
    if previous is None:
        return None
    stored, backend = await _stored(state, previous, owner, "previous_response_id")
    if stored.model != route.name:
        raise GatewayError(400, f"previous_response_id {previous!r} belongs to model {stored.model!r}", param="previous_response_id")
    return backend


async def _stored(state: GatewayState, response_id: str, owner: str, param: str | None = None) -> tuple[StoredResponse, Backend]:
    """``owner``'s stored response ``response_id`` and the backend holding it.

    A malformed id gets the engine's own 400 (what SGLang answers it, word for word); an id nobody created
    and one another key created get the same 404, so that ids of other keys are never confirmed. Replicas sharing a
    store look an unknown id up there: while it does not answer, 503 (the id may be another replica's).
    """
    if not response_id.startswith(RESPONSE_ID_PREFIX):
        raise GatewayError(400, f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.", param="response_id")
    try:
        stored = await state.responses.find_shared(response_id, owner)
    except StoreUnavailable:
        raise GatewayError(
            503, f"Response {response_id!r} is not known to this replica and the shared store is unreachable; retry shortly",
            code="shared_store_unavailable", param=param, headers={"Retry-After": "1"},
        ) from None
    if stored is None:
        raise GatewayError(404, f"No response found with id {response_id!r}", code="response_not_found", param=param)
    route = state.registry.route(stored.model)
    backend = route.backend_named(stored.backend) if route is not None else None
    if backend is None:
        raise GatewayError(
            404, f"Response {response_id!r} is gone: the engine that stored it was replaced", code="response_not_found", param=param
        )
    return stored, backend


async def proxied_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    """POST of a proxied path as plain ASGI: the same handler and errors as the FastAPI routes, without
    their router, dependency machinery and per-message ``send`` wrappers (scope["app"] must be set).

    The app serves every route of :data:`gateway.core.endpoints.PROXIED` this way (see ``gateway.app.GatewayAPI``);
    the FastAPI routes made from the same table below serve anything that reaches the router (an app
    without the fast path) and list the routes in ``/openapi.json``.
    """
    request = Request(scope, receive)
    endpoint = scope["app"].proxied_routes[scope["path"]]
    try:
        response = await _proxied(request, endpoint)
    except GatewayError as error:
        note_error(scope, error)
        response = error_response(error, shaped_for(endpoint.path, endpoint.dialect))
    except ClientDisconnect:
        raise  # left while sending its body: the request-context middleware records it (499)
    except Exception as error:  # noqa: BLE001 - every failure leaves as JSON in the route's dialect
        response = unexpected_error_response(scope, error, shaped_for(endpoint.path, endpoint.dialect))
    await response(scope, receive, send)


def add_proxied_route(target: APIRouter | FastAPI, endpoint: ProxiedRoute, *, listed: bool = True) -> None:
    """The FastAPI route of ``endpoint`` (the same handler as the fast path)."""

    async def handler(request: Request) -> Response:
        return await _proxied(request, endpoint)

    target.add_api_route(endpoint.path, handler, methods=["POST"], summary=endpoint.summary, name=endpoint.path, include_in_schema=listed)


for _endpoint in PROXIED:
    add_proxied_route(api_routes, _endpoint)


@api_routes.get(RESPONSE_BY_ID)
async def get_response(response_id: str, request: Request) -> Response:
    return await _stored_response_call(request, response_id, "GET", f"/v1/responses/{response_id}")


@api_routes.post(RESPONSE_CANCEL)
async def cancel_response(response_id: str, request: Request) -> Response:
    return await _stored_response_call(request, response_id, "POST", f"/v1/responses/{response_id}/cancel")


async def _stored_response_call(request: Request, response_id: str, method: str, path: str) -> Response:
    state = _state(request)
    stored, backend = await _stored(state, response_id, request_owner(request.scope))
    info = request_info(request.scope)
    if info is not None:
        info.model = stored.model
    assert state.proxy is not None, "the app's lifespan did not run"
    return await state.proxy.call_backend(stored.model, backend, method, quote(path), info or RequestInfo("-", method, path))


def note_error(scope: Scope, error: GatewayError | str) -> None:
    """Keep a short reason for the request's log line (the first one wins)."""
    info = request_info(scope)
    if info is not None and info.error is None:
        message = error if isinstance(error, str) else error.log_detail or error.message
        info.error = message[:300]
        info.error_code = None if isinstance(error, str) else error.code


def unexpected_error_response(scope: Scope, error: BaseException, dialect: Dialect = Dialect.OPENAI) -> Response:
    """Log an unexpected error with its traceback and request id; answer a bare 500."""
    info = request_info(scope)
    trace = "".join(traceback.format_exception(error))
    logger.error("unhandled error in request {}: {}", info.request_id if info else "-", trace)
    return error_response(GatewayError(500, "internal gateway error", code="internal_error"), dialect)


@api_routes.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
    routes = [route for route in state.registry.routes() if _may_use(tenant, route)]
    await _probes(state).fill_context_lengths([backend for route in routes for backend in route.replicas])
    data = [card for route in routes for card in _cards(route, state)]
    return _json({"object": "list", "data": data})


@api_routes.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    state = _state(request)
    route = state.registry.resolve(model_id)
    tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
    if route is None or not _may_use(tenant, route):
        raise GatewayError(404, f"The model {model_id!r} does not exist", code="model_not_found", param="model")
    await _probes(state).fill_context_lengths([route.backend])
    return _json(next(card for card in _cards(route, state) if card["id"] == model_id))


@api_routes.get("/health")
@api_routes.head("/health", include_in_schema=False)  # load balancers often probe with HEAD
async def health() -> Response:
    """Liveness: the gateway process answers (engines are /ready's business)."""
    return _json({"status": "ok"})


@api_routes.get("/ready")
@api_routes.head("/ready", include_in_schema=False)
async def ready(request: Request) -> Response:
    """200 only when every model has enough healthy replicas (``balancing.min_ready``, at most all of
    them; one for most models); 503 naming the ones that do not. Replicas sharing a store say whether it answers
    (``shared_store``), without changing the status: a replica that cannot reach it still serves (docs/scaling.md)."""
    state = _state(request)
    if state.draining:  # SIGTERM with gateway.shutdown_delay_s: still serving, but the load balancer should stop sending
        return _json({**error_body("draining: this gateway is stopping", "service_unavailable", "draining"), "status": "draining"}, 503)
    routes = state.registry.routes()
    models = dict(await asyncio.gather(*(_model_readiness(state, route) for route in routes)))
    extra = {"shared_store": state.shared_store.status()} if state.shared_store is not None else {}
    down = [f"{name} ({m['reason']})" for name, m in models.items() if not m["ready"]]
    if down:
        body = error_body("not ready: " + ", ".join(down), "service_unavailable", "not_ready")
        return _json({**body, "status": "not_ready", "models": models, **extra}, 503)
    return _json({"status": "ready", "models": models, **extra})


async def _model_readiness(state: GatewayState, route: ModelRoute) -> tuple[str, dict[str, Any]]:
    if route.asleep:  # residency: its engine starts at its next request, which the gateway takes now
        waker = state.proxy.waker if state.proxy is not None else None
        starting = waker is not None and waker.status(route.name) == "starting"
        return route.name, {"ready": True, "asleep": True, **({"starting": True} if starting else {})}
    probes = _probes(state)
    reasons = await asyncio.gather(*(probes.not_ready(backend, state.settings.health_timeout_s) for backend in route.replicas))
    healthy = sum(1 for reason in reasons if reason is None)
    needed = min(state.settings.balancing_for(route.name).min_ready, len(route.replicas))
    item: dict[str, Any] = {"ready": healthy >= needed}
    if len(route.replicas) > 1:
        item["replicas_ready"] = healthy
    if not item["ready"]:
        failing = [f"replica {b.replica}: {reason}" if len(route.replicas) > 1 else reason for b, reason in zip(route.replicas, reasons, strict=True) if reason]
        item["reason"] = "; ".join(failing)
    return route.name, item


@api_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text; ``gateway_engine_up`` of url models is their ``/health`` now (probed here)."""
    state = _state(request)
    probes = _probes(state)
    url_backends = [backend for route in state.registry.routes() for backend in route.replicas if not backend.managed]
    await asyncio.gather(*(probes.not_ready(backend, state.settings.health_timeout_s) for backend in url_backends))
    text = state.metrics.exposition()
    tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
    if tenant is not None:  # a client key: its models and itself (the admin and metrics keys and an open gateway: all)
        names = {name for route in state.registry.routes() if _may_use(tenant, route) for name in route.names}
        text = scoped_exposition(text, tenant.name, lambda label: label in names or label.partition(":")[0] in names)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


def _cards(route: ModelRoute, state: GatewayState) -> list[dict[str, Any]]:
    backend = route.backend
    waker = state.proxy.waker if state.proxy is not None else None
    residency = waker.status(route.name) if waker is not None else None
    extra = {"status": residency} if residency is not None else {}  # resident / sleeping / starting (an extension field)
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
            **extra,
        }
        for name in route.names
    ]
