"""Serve the status page (``/``) and its files (``/ui/<name>``), read once from the package.

The page is static: it holds no data and no secret, so it is served without a key (see
:func:`gateway.core.endpoints.is_status_page`). What it shows, it fetches in the browser from the API,
with the keys the user types in: ``/ready`` (open), ``/v1/models`` and ``/metrics`` (a client key when
client keys are set), ``/admin/models``, ``/admin/workers`` and ``/admin/batches`` (the admin key), and the playground streams
through ``/v1/chat/completions``. ``gateway.status_page: false`` turns it off (404), read per request so
that a reload applies.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.core.endpoints import STATUS_PAGE, UI_PREFIX
from gateway.core.errors import GatewayError
from gateway.core.state import GatewayState

ui_routes = APIRouter(include_in_schema=False)

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
# Only the page's own files run in it: no inline script, no other origin (the playground's answers are
# model output, put into the page as text, never as HTML).
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def _file(name: str) -> bytes | None:
    """The packaged file ``name`` (None: not one of the page's files)."""
    if "/" in name or name.startswith(".") or not any(name.endswith(suffix) for suffix in _TYPES):
        return None
    path = resources.files("gateway.ui") / "static" / name
    return path.read_bytes() if path.is_file() else None


def _serve(request: Request, name: str) -> Response:
    state: GatewayState = request.app.state.gateway
    body = _file(name) if state.settings.status_page else None
    if body is None:
        raise GatewayError(404, "no such file of the status page (or gateway.status_page is false)", code="not_found")
    suffix = name[name.rindex(".") :]
    return Response(body, media_type=_TYPES[suffix], headers=_HEADERS)


@ui_routes.get(STATUS_PAGE)
@ui_routes.head(STATUS_PAGE)
async def status_page(request: Request) -> Response:
    return _serve(request, "index.html")


@ui_routes.get(UI_PREFIX + "{name}")
async def status_page_file(name: str, request: Request) -> Response:
    return _serve(request, name)
