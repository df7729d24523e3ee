"""The app's lifespan: one per process role, each readable top to bottom.

Every role runs inside :func:`data_plane` (the stored-response index, the upstream session and stream pool, the
health probes, the usage ledger and the proxy: opened first, closed last), then:

- :func:`serve_as_worker`: a worker process. It routes with the state its control process sends, hands it each ledger
  row, and creates batches that the control process runs. No engines of its own.
- :func:`serve_as_owner`: the only process, or the control process of workers. Budgets from the ledger, the engines
  booted and supervised, the worker processes started, the batches run; stopped in the reverse order. A replica
  sharing a store (``gateway.replicas.shared``, one process) opens it first: :func:`shared_replica`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from loguru import logger

from gateway.batches.service import Batches
from gateway.config import GatewaySettings
from gateway.control.controller import Controller
from gateway.control.worker_link import WorkerLink
from gateway.control.workers import WorkerPlan, WorkerSupervisor
from gateway.core.health import HealthProbes
from gateway.core.responses_index import open_response_index
from gateway.core.shared_quarantine import SharedQuarantine
from gateway.core.shared_responses import SharedResponses
from gateway.core.shared_store import SharedStore, replica_name
from gateway.core.state import GatewayState
from gateway.core.tracing import Tracing
from gateway.data.grammar_costs import GrammarCosts
from gateway.data.native_streams import BUILT as NATIVE_BUILT
from gateway.data.proxy import Proxy
from gateway.data.stream_pool import StreamPool
from gateway.data.upstream_session import upstream_session
from gateway.edge.auth import KeyHolder
from gateway.tenants.ledger import Ledger
from gateway.tenants.quotas import restore_budgets_when_readable
from gateway.tenants.shared_quotas import SharedQuotas


@dataclass(frozen=True)
class AppParts:
    """What ``create_app`` builds once and the lifespan of each role uses."""

    settings: GatewaySettings
    state: GatewayState
    keys: KeyHolder
    controller: Controller
    ledger: Ledger
    tracing: Tracing | None  # spans in the process that records requests (a worker, or the only process)
    batches: Batches | None  # None: the batch API is off (or nowhere to keep its files)
    workers: WorkerPlan | None  # this is the control process of worker processes
    link: WorkerLink | None  # this is one of those workers


def lifespan_for(parts: AppParts) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan for the role ``parts`` say: a worker when it has a link to a control process."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with data_plane(app, parts):
            role = serve_as_worker(app, parts, parts.link) if parts.link is not None else serve_as_owner(app, parts)
            async with role:
                yield

    return lifespan


@asynccontextmanager
async def data_plane(app: FastAPI, parts: AppParts) -> AsyncIterator[None]:
    """What every request needs, opened before the role starts and closed after it stopped: the ledger is closed
    after the last request (uvicorn's graceful shutdown ran first) and writes every row."""
    settings, state = parts.settings, parts.state
    try:
        state.responses = open_response_index(settings.state_dir)  # who owns which stored response, on disk
        state.responses.shared = parts.link is not None  # a worker: the other workers read what it records
    except RuntimeError as error:
        app.state.startup_error = error
        raise
    # Streams and plain requests go upstream over pools of their own (gateway.data.stream_pool); the calls off the
    # request path (a stored response by id, a prompt counted) over aiohttp; health and model-card probes over httpx.
    session = upstream_session(settings.upstream_connect_timeout_s, settings.upstream_read_timeout_s, settings.upstream_max_connections)
    streams = StreamPool(
        settings.upstream_connect_timeout_s, settings.upstream_read_timeout_s, settings.upstream_max_connections,
        coalesce_s=settings.stream_coalesce_ms / 1000, coalesce_min_streams=settings.stream_coalesce_min_streams,
        native=settings.relay_native,
    )  # fmt: skip
    plain = StreamPool(settings.upstream_connect_timeout_s, settings.upstream_read_timeout_s, settings.upstream_max_connections, plain=True)
    if settings.relay_native and not NATIVE_BUILT:
        logger.warning(
            "gateway: relay_native is on but the native relay (gateway/data/_relay_loop.c) is not built in this install "
            "(no C compiler when it was installed?): streams are relayed in Python, at more CPU per event"
        )
    state.probes = HealthProbes(settings.health_timeout_s, settings.upstream_connect_timeout_s)
    try:
        await parts.ledger.start()  # one row per request, written off the hot path (a database down fails no request)
        async with session:
            waker = parts.controller.residency if parts.link is None else None  # residency runs in one process (gateway.config)
            grammar_costs = GrammarCosts(lambda: state.settings, state.probes.learn_version)
            state.proxy = Proxy(
                session, state.metrics, state.quarantine, state.responses, streams, waker, parts.tracing, state.registry, grammar_costs,
                plain,
            )  # fmt: skip
            try:
                yield
            finally:
                await streams.close()
                await plain.close()
                await asyncio.to_thread(grammar_costs.close)
    finally:
        await state.probes.aclose()
        await asyncio.to_thread(state.responses.close)  # writes what is pending
        await parts.ledger.close()
        if parts.tracing is not None:
            await asyncio.to_thread(parts.tracing.shutdown)  # exports the spans still queued


@asynccontextmanager
async def serve_as_worker(app: FastAPI, parts: AppParts, link: WorkerLink) -> AsyncIterator[None]:
    """A worker process: the control process's routing state and its key policy, rows handed to it as requests end."""
    await link.start(parts.state, parts.keys)
    parts.ledger.hand_to(link.send_rows)
    link.apply(link.version, link.first)
    if parts.batches is not None:  # creates batches; the control process runs them
        await parts.batches.open(None, app, parts.keys, parts.state.metrics)
    try:
        yield
    finally:
        if parts.batches is not None:
            await parts.batches.close(0)
        await link.close()


@asynccontextmanager
async def serve_as_owner(app: FastAPI, parts: AppParts) -> AsyncIterator[None]:
    """The process that owns the engines: what fails its start is kept in ``app.state.startup_error`` (the CLI says it
    in one line); at stop, lines in flight and the workers' requests end before the engines."""
    settings, state = parts.settings, parts.state
    supervisor: WorkerSupervisor | None = None
    restoring: asyncio.Task[None] | None = None  # budgets restored once the ledger answers (down at start)
    replica = AsyncExitStack()  # a replica sharing a store: the store's exchanges, closed last
    try:
        try:
            restoring = await restore_budgets_when_readable(app.state.quotas, parts.ledger)
            if settings.replicas.shared:
                await replica.enter_async_context(shared_replica(app, parts))
            await parts.controller.boot()
            await parts.controller.start()
            if parts.workers is not None:
                plan = parts.workers
                supervisor = WorkerSupervisor(state, parts.keys, plan.count, plan.runtime_dir, host=plan.host, port=plan.port,
                                              verbose=plan.verbose, quotas=app.state.quotas)  # fmt: skip
                state.peers = supervisor
                await supervisor.start()
            if parts.batches is not None:  # takes up every unfinished batch (a restart resumes them here)
                await parts.batches.open(app.state.line_chain, app, parts.keys, state.metrics)
        except BaseException as error:
            app.state.startup_error = error
            raise
        yield
    finally:
        if restoring is not None:
            restoring.cancel()
        if parts.batches is not None:  # lines in flight finish while the engines still run
            await parts.batches.close(settings.shutdown_grace_s)
        if supervisor is not None:
            await supervisor.stop(settings.shutdown_grace_s)  # the workers' requests end before the engines
        await parts.controller.close()  # stops every engine the gateway owns
        await replica.aclose()


@asynccontextmanager
async def shared_replica(app: FastAPI, parts: AppParts) -> AsyncIterator[None]:
    """A replica sharing a store: its per-key limits, stored responses and quarantine exchanged every
    ``replicas.sync_interval_s`` (a store down at start fails nothing: it is said, and tried every round)."""
    settings, state = parts.settings, parts.state
    config = settings.replicas
    assert settings.usage.database_url is not None  # gateway.config refuses a shared replica without one
    store = SharedStore(settings.usage.database_url.get_secret_value(), replica_name(config.name), config.sync_interval_s,
                        config.expected, state.metrics.shared_store_gauge(), settings.usage.database_timeout_s)  # fmt: skip
    quotas = SharedQuotas(app.state.quotas, store, lambda: parts.keys.policy.limited)
    restoring = await restore_budgets_when_readable(quotas.total, parts.ledger)  # the sums start where the ledger is
    responses = state.responses.remote = SharedResponses(store)
    quarantine = SharedQuarantine(state.quarantine, store)
    state.shared_store = store
    rounds = asyncio.create_task(store.rounds([quotas.round, quarantine.round, responses.round]), name="shared store rounds")
    try:
        yield
    finally:
        store.stop_rounds()
        await rounds
        if restoring is not None:
            restoring.cancel()
        await quarantine.close()
        await responses.close()
        await store.close()
