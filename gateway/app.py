"""The app factory: compose routes, middleware, error handlers and the lifespan.

``create_app`` takes ready-made settings and a model registry, so tests can build an app around
an engine they already run; ``app_from_config`` builds all of it (engines included) from one YAML.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.batches.api import batch_routes
from gateway.batches.dispatch import line_chain
from gateway.batches.service import batches_for
from gateway.config import GatewaySettings, gateway_settings
from gateway.control.admin import admin_routes
from gateway.control.controller import Controller
from gateway.control.swap import SwapExecutor
from gateway.control.usage_routes import usage_routes
from gateway.control.worker_link import WorkerLink, admin_forwarder
from gateway.control.workers import WorkerPlan
from gateway.core.endpoints import FILES, INVOCATIONS, MESSAGE_BATCHES, PROXIED_BY_PATH, ProxiedRoute, dialect_for_path
from gateway.core.errors import GatewayError, error_response, shaped_for
from gateway.core.metrics import Metrics
from gateway.core.registry import Registry
from gateway.core.state import GatewayState
from gateway.core.tracing import Tracing
from gateway.data.answer_extensions import HEADER as EXTENSIONS_HEADER
from gateway.data.routes import add_proxied_route, api_routes, note_error, proxied_endpoint, unexpected_error_response
from gateway.edge.auth import AuthMiddleware, KeyHolder, key_policy
from gateway.edge.middleware import BodyLimitMiddleware, JSONCORSMiddleware, RequestContextMiddleware
from gateway.edge.quota import QuotaMiddleware
from gateway.lifespans import AppParts, lifespan_for
from gateway.tenants.keys import tenants_of
from gateway.tenants.ledger import open_ledger
from gateway.tenants.quotas import Quotas
from gateway.ui.routes import ui_routes
from launch.config import DeploymentConfig
from launch.preflight import preflight_all


class GatewayAPI(FastAPI):
    """FastAPI behind one middleware chain (``chain``: request id/log -> CORS -> auth -> body limit) that serves
    the proxied POST routes itself, straight to :func:`gateway.data.routes.proxied_endpoint` (``proxied``).

    Those routes carry nearly all the traffic, and a streamed answer sends one message per SSE
    chunk: FastAPI's per-request machinery (telemetry check, exception and exit-stack middleware,
    router, dependency solving) and its ``send`` wrappers cost more than the proxying itself.
    Everything else (other paths and methods) goes on, inside the same chain, to FastAPI as usual;
    the lifespan goes to FastAPI directly.
    """

    proxied: Any = None
    chain: Any = None
    proxied_routes: Mapping[str, ProxiedRoute] = PROXIED_BY_PATH  # path -> route, served by the fast path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # (a coroutine function: ASGI 3)
        if self.chain is not None and scope["type"] == "http":
            scope["app"] = self
            await self.chain(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def dispatch(self, scope: Scope, receive: Receive, send: Send) -> Coroutine[Any, Any, None]:
        """The innermost step of the chain: the fast path, or FastAPI (the awaitable of either, not a coroutine of its
        own around it, which each of the request's awaits would resume)."""
        if self.proxied is not None and scope["method"] == "POST" and scope["path"] in self.proxied_routes:
            return self.proxied(scope, receive, send)  # type: ignore[no-any-return]
        return super().__call__(scope, receive, send)


def create_app(
    settings: GatewaySettings,
    registry: Registry | None = None,
    *,
    deployment: DeploymentConfig | None = None,
    boot: bool = False,
    overrides: dict[str, Any] | None = None,
    watch: bool = False,
    log_dir: str | Path | None = None,
    invocations: bool = False,
    workers: WorkerPlan | None = None,
    link: WorkerLink | None = None,
) -> FastAPI:
    """A gateway app. With ``boot``, the lifespan applies ``deployment`` to an empty registry (its engines then the
    gateway's: supervised, swappable, stopped at shutdown), as a reload would; without, it serves ``registry`` as given
    (backends run by someone else: tests, a model loaded by MLflow). ``deployment`` (from a file) enables reloads;
    ``overrides``: the CLI's host/port, kept across reloads; ``watch`` reloads on file changes; ``invocations`` adds
    ``POST /invocations``. ``workers`` makes this the control process of worker processes, ``link`` one of those
    workers (:mod:`gateway.control.workers`); each role's lifespan: :mod:`gateway.lifespans`."""
    registry = registry if registry is not None else Registry()
    state = GatewayState(settings=settings, registry=registry, metrics=Metrics(registry))
    parts = _parts(state, deployment=deployment, boot=boot, overrides=overrides, watch=watch, log_dir=log_dir, workers=workers, link=link)
    # No trailing-slash redirects: a 307 built from the client's Host header is not an API answer.
    app = GatewayAPI(title="sglang-gateway", lifespan=lifespan_for(parts), docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.gateway, app.state.startup_error, app.state.controller, app.state.batches = state, None, parts.controller, parts.batches
    _include_routes(app, link, invocations)
    _install_error_handlers(app)
    # per named key, across reloads (tests move its clock); a worker's holds its share, the control's the sums
    # replicas sharing a store: each holds its share of the sums of all (gateway.tenants.shared_quotas)
    quotas = app.state.quotas = link.quotas if link is not None else Quotas(share=1 / settings.replicas.expected if settings.replicas.shared else 1.0)
    app.proxied, app.chain = proxied_endpoint, _middleware_chain(app, parts, quotas)
    # batch lines: the same chain less the client's connection (key check, CORS, body cap): gateway.batches.dispatch
    app.state.line_chain = line_chain(
        app.dispatch, metrics=state.metrics, ledger=parts.ledger, quotas=quotas, tracing=parts.tracing, log_requests=settings.log_requests
    )
    return app


def _parts(state: GatewayState, *, workers: WorkerPlan | None, link: WorkerLink | None, log_dir: str | Path | None, **control: Any) -> AppParts:
    """The app's parts, built once: keys, ledger, tracing, the controller (``control``: its deployment options), batches."""
    settings = state.settings
    state.ledger = ledger = open_ledger(settings, state.metrics.usage_rows_dropped, state.metrics.usage_rows_refused)
    keys = KeyHolder(key_policy(tenants_of(settings), settings.resolved_admin_keys(), settings.open_paths, settings.resolved_metrics_keys()))
    # Spans in the process that records the request: a worker, or the only process (the control process of
    # workers only forwards). Exported from the SDK's own thread; the lifespan flushes them at shutdown.
    tracing = Tracing(settings.tracing) if settings.tracing.enabled and workers is None else None
    controller = Controller(state, keys, SwapExecutor(state, log_dir=log_dir), **control)
    return AppParts(settings, state, keys, controller, ledger, tracing, batches_for(state), workers, link)


def _include_routes(app: GatewayAPI, link: WorkerLink | None, invocations: bool) -> None:
    app.include_router(api_routes)
    app.include_router(batch_routes())
    app.include_router(ui_routes)
    app.include_router(admin_forwarder(link) if link is not None else admin_routes)
    if link is None:  # a worker forwards /admin/usage to the control process too
        app.include_router(usage_routes)
    if invocations:
        app.proxied_routes = {**PROXIED_BY_PATH, INVOCATIONS.path: INVOCATIONS}
        add_proxied_route(app, INVOCATIONS, listed=False)


def _middleware_chain(app: GatewayAPI, parts: AppParts, quotas: Quotas) -> Any:
    """Outermost last: request id/log -> CORS -> auth -> per-key limits -> body limit -> the app's dispatch."""
    settings, link = parts.settings, parts.link
    layers: list[tuple[type[Any], dict[str, Any]]] = [
        (
            BodyLimitMiddleware,
            {
                "max_bytes": settings.max_body_bytes, "timeout_s": settings.http.body_timeout_s, "deadline_s": settings.http.body_deadline_s,
                # the multipart framing of an upload; a Message Batch's requests come in its create's body
                "larger": {FILES: settings.batches.max_file_bytes + 1024 * 1024, MESSAGE_BATCHES: settings.batches.max_file_bytes},
            },  # fmt: skip
        ),
        (QuotaMiddleware, {"quotas": quotas}),
        (AuthMiddleware, {"holder": parts.keys}),
    ]
    if settings.cors_allow_origins:
        cors = {
            "allow_origins": settings.cors_allow_origins,
            "allow_methods": ["GET", "POST", "OPTIONS"],
            "allow_headers": ["authorization", "content-type", "x-request-id", "x-api-key", "anthropic-version", "anthropic-beta", EXTENSIONS_HEADER],
            "expose_headers": ["x-request-id", "retry-after"],
        }
        layers.append((JSONCORSMiddleware, cors))
    layers.append(
        (
            RequestContextMiddleware,
            {
                "metrics": parts.state.metrics, "log_requests": settings.log_requests,
                "worker": link.index if link is not None else None, "record": parts.workers is None, "ledger": parts.ledger,
                "tracing": parts.tracing,
            },
        )  # fmt: skip
    )
    chain: Any = app.dispatch
    for middleware, options in layers:
        chain = middleware(chain, **options)
    return chain


def app_from_config(
    deployment: DeploymentConfig,
    *,
    host: str | None = None,
    port: int | None = None,
    log_dir: str | Path | None = None,
    watch: bool = False,
    workers: WorkerPlan | None = None,
    settings: GatewaySettings | None = None,
) -> tuple[FastAPI, GatewaySettings]:
    """The app for a whole deployment: managed engines (started by the lifespan's boot) and external URLs.

    Every engine is preflighted first, so a bad model path or a busy port fails at once with its message.
    ``settings``: the deployment's, when the caller parsed them already (``host`` and ``port`` applied).
    """
    if settings is None:
        settings = gateway_settings(deployment, host=host, port=port)
    preflight_all(deployment)
    app = create_app(
        settings, deployment=deployment, boot=True, overrides={"host": host, "port": port}, watch=watch,
        log_dir=log_dir, invocations=True, workers=workers,
    )  # fmt: skip
    return app, settings


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI-shaped JSON; never a stack trace."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, error: GatewayError) -> Response:
        note_error(request.scope, error)
        path = request.url.path
        return error_response(error, shaped_for(path, dialect_for_path(path)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on {request.url.path}"}
        gateway_error = GatewayError(error.status_code, message.get(error.status_code, str(error.detail)), headers=dict(error.headers or {}))
        return await _gateway_error(request, gateway_error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> Response:
        return await _gateway_error(request, GatewayError(400, "invalid request"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> Response:
        path = request.url.path
        return unexpected_error_response(request.scope, error, shaped_for(path, dialect_for_path(path)))
