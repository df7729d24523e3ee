"""A worker process's end of the channel to the control process: routing state in, reports out.

The worker applies each routing state it receives (:func:`~gateway.control.snapshot.apply_state`) and
confirms its version; every :data:`REPORT_INTERVAL_S` it reports, when something changed, its requests in
flight per backend (backends it no longer routes to included, until their last request ends) and the
request shapes whose upstream connection broke, what its named keys used (their limits hold across workers:
:mod:`gateway.tenants.quotas`); asked in a sync round, the shapes of the requests it has
upstream on one backend (the suspects when that engine froze); told that the control process drains, its state
drains too (``/ready`` 503). Should the channel break, the worker keeps serving with the
last state it has (the control process dying takes the workers down anyway: parent-death signal).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any
from urllib.parse import unquote

import aiohttp
from fastapi import APIRouter, Request
from loguru import logger
from starlette.responses import Response

from gateway.control import channel
from gateway.control.snapshot import RemoteBackend, RoutingState, apply_state
from gateway.core.context import request_info
from gateway.core.errors import GatewayError
from gateway.core.poison import Suspicion
from gateway.core.state import GatewayState
from gateway.edge.auth import KeyHolder
from gateway.tenants.quotas import Quotas

REPORT_INTERVAL_S = 0.1


class WorkerLink:
    """Keeps one worker's :class:`GatewayState` in step with the control process."""

    def __init__(self, sock: socket.socket, index: int, version: int, first: RoutingState, admin_socket: str, count: int = 1) -> None:
        self.sock, self.index, self.version, self.first = sock, index, version, first
        self.quotas = Quotas(share=1 / max(1, count))  # this worker's share of every named key's limits
        self.admin_socket = admin_socket
        self.synced = 0  # the control's last sync round, answered
        self.state: GatewayState | None = None
        self.keys: KeyHolder | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._retired: list[tuple[str, RemoteBackend]] = []  # no longer routed to, requests still in flight
        self._last_in_flight: dict[tuple[str, str], int] = {}
        self.admin: aiohttp.ClientSession | None = None

    async def start(self, state: GatewayState, keys: KeyHolder) -> None:
        self.state, self.keys = state, keys
        reader, self._writer = await asyncio.open_unix_connection(sock=self.sock)
        # no timeout: a reload through the admin API lasts as long as its engines take to start
        self.admin = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.admin_socket), timeout=aiohttp.ClientTimeout(total=None))
        self._tasks = [asyncio.create_task(self._receive(reader)), asyncio.create_task(self._report_loop())]

    def listening(self) -> None:
        """Tell the control process this worker accepts on the port now."""
        if self._writer is not None:
            channel.write(self._writer, ("listening",))
            self._report(force=True)

    def send_rows(self, rows: list[Any]) -> bool:
        """Usage ledger rows of requests that ended, to the control process (it writes them); False: no channel."""
        if self._writer is None or self._writer.is_closing():
            return False
        channel.write(self._writer, ("rows", rows))
        return True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()
        if self.admin is not None:
            await self.admin.close()

    def apply(self, version: int, routing: RoutingState) -> None:
        """Route with ``routing`` from now on (also used once, before serving, with the first state)."""
        assert self.state is not None and self.keys is not None
        before = {(route.name, backend) for route in self.state.registry.routes() for backend in (*route.replicas, route.front) if backend}
        apply_state(routing, self.state.registry, self.state.quarantine, self.state.settings)
        self.state.settings = routing.settings
        self.keys.policy = routing.keys
        now = {id(backend) for route in self.state.registry.routes() for backend in (*route.replicas, route.front) if backend}
        self._retired += [(name, b) for name, b in before if id(b) not in now and isinstance(b, RemoteBackend)]
        self.version = version

    async def _receive(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                kind, number, routing = await channel.receive(reader)
                if kind == "state" and number > self.version:
                    self.apply(number, routing)
                    self._report(force=True)
                elif kind == "sync":
                    self.synced = number
                    self._report(force=True, upstream_on=routing)
                elif kind == "drain" and self.state is not None:  # the control process got SIGTERM: /ready says so
                    self.state.draining = True
                elif kind == "quota":
                    views, absorbed = routing
                    self.quotas.apply(views, self.index, absorbed.get(self.index, 0))
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            logger.warning("worker {}: the channel to the control process closed ({}); serving with the last routing state",
                           self.index, type(error).__name__)  # fmt: skip

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            self._report()

    def _report(self, *, force: bool = False, upstream_on: tuple[str, str] | None = None) -> None:
        """Send the counts (when changed, or ``force``); ``upstream_on`` (model, identity): with the shapes of the
        requests upstream on that backend now."""
        assert self.state is not None
        routes = self.state.registry.routes()
        routed = [(route.name, b) for route in routes for b in (*route.replicas, route.front) if b]
        self._retired = [(name, b) for name, b in self._retired if b.in_flight > 0 or b.lost]
        in_flight: dict[tuple[str, str], int] = {}
        lost: list[tuple[str, str, Suspicion]] = []  # (model, identity, (shape, key, answered before))
        with_adapters = {route.name for route in routes if route.adapters}
        for name, backend in (*routed, *self._retired):
            if backend.in_flight:
                key = (name, backend.identity)
                in_flight[key] = in_flight.get(key, 0) + backend.in_flight
                for adapter in backend.adapters_in_flight() if name in with_adapters else ():  # as "<name>:<adapter>": an unload waits on it
                    key = (f"{name}:{adapter}", backend.identity)
                    in_flight[key] = in_flight.get(key, 0) + 1
            while backend.lost:
                lost.append((name, backend.identity, backend.lost.popleft()))
        linger_s = self.state.settings.watchdog.suspect_linger_s
        upstream = [
            (name, backend.identity, suspicion) for name, backend in (*routed, *self._retired) if (name, backend.identity) == upstream_on
            for suspicion in backend.suspects(linger_s)
        ]  # fmt: skip
        usage = self.quotas.report()
        if not force and not lost and usage is None and in_flight == self._last_in_flight:
            return
        self._last_in_flight = in_flight
        if self._writer is not None and not self._writer.is_closing():
            channel.write(self._writer, ("report", self.version, self.synced, in_flight, lost, upstream, usage))


def escapes_admin(path: str) -> bool:
    """Whether ``path`` (under /admin/, as routed: decoded once) has a dot segment or a backslash at any depth of
    percent-decoding: the forwarded URL is normalised on the way (``/admin/../ready`` is the control's ``/ready``)."""
    for _ in range(8):
        if "\\" in path or any(segment in (".", "..") for segment in path.split("/")):
            return True
        decoded = unquote(path)
        if decoded == path:
            return False
        path = decoded
    return True  # encoded eight times over: nobody's admin path


def admin_forwarder(link: WorkerLink) -> APIRouter:
    """``/admin/*`` on a worker: forwarded as it came to the control process, which owns the engines."""
    routes = APIRouter()

    @routes.api_route("/admin/{path:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
    async def forward(path: str, request: Request) -> Response:
        assert link.admin is not None
        if escapes_admin(path):
            raise GatewayError(400, "an admin path has no '.' or '..' segments (encoded or not)", code="invalid_admin_path")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        info = request_info(request.scope)
        if info is not None:  # the control process logs nothing of its own for it; its errors name the same id
            headers["x-request-id"] = info.request_id
        try:
            async with link.admin.request(
                request.method, f"http://control/admin/{path}", params=list(request.query_params.multi_items()),
                data=await request.body(), headers=headers,
            ) as answer:  # fmt: skip
                body = await answer.read()
                kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "retry-after")}
                return Response(body, status_code=answer.status, headers=kept)
        except aiohttp.ClientError as error:
            raise GatewayError(503, f"the control process is not answering ({type(error).__name__})", code="control_unavailable") from None

    return routes
