"""What the data plane and the control plane share: one object, stored on ``app.state.gateway``.

Routes read it per request; the controller (reloads, swaps, the watchdog) changes ``settings`` and the
registry's routes in place. No module globals: tests build many apps side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.responses import Response

from gateway.config import GatewaySettings
from gateway.core.backends import Backend
from gateway.core.call import Call
from gateway.core.context import RequestInfo
from gateway.core.events import EventLog
from gateway.core.health import HealthProbes
from gateway.core.metrics import Metrics
from gateway.core.poison import Quarantine
from gateway.core.registry import ModelRoute, Registry
from gateway.core.responses_index import ResponseIndex
from gateway.core.shared_store import SharedStore


class Peers(Protocol):
    """The other processes that route requests to this process's backends (the control process's workers)."""

    async def settle(self, timeout_s: float) -> bool:
        """Wait until every worker routes with the registry as it is now (False: not all did within ``timeout_s``)."""
        ...

    def in_flight(self, model: str, identity: str) -> int:
        """Requests the workers have in flight on the backend ``identity`` of ``model``."""
        ...

    async def upstream_shapes(self, model: str, identity: str, timeout_s: float) -> list[str]:
        """The shapes of the requests the workers have upstream on that backend now (suspects of a freeze)."""
        ...


class Waker(Protocol):
    """The residency of models whose engines start on demand (:mod:`gateway.control.residency`), as the data plane
    sees it: a request enters before it is sent (waking an asleep model) and leaves once it holds its backend."""

    def manages(self, model: str) -> bool: ...

    async def enter(self, route: ModelRoute, owner: str | None = None) -> ModelRoute:
        """Count a request of ``route``'s model (it is used now); when asleep (or its group turn is over), wait until
        its engine is up (its new route), or raise GatewayError (503 with Retry-After) when it could not start in time,
        429 when ``owner`` (the client key) caused its group's limit of cold starts."""
        ...

    def leave(self, model: str) -> None: ...

    def status(self, model: str) -> str | None:
        """``resident``, ``sleeping`` or ``starting`` (None: the model has no residency section)."""
        ...


class Forwarder(Protocol):
    """The data plane's forwarder (:class:`gateway.data.proxy.Proxy`) as the routes reach it through the state: named
    by its shape, since core does not import the data plane."""

    waker: Waker | None  # models whose engines start on demand

    async def forward(self, call: Call) -> Response:
        """Admit one validated request, send it to a replica of its model and answer it (plain or a stream)."""
        ...

    async def call_backend(self, model: str, backend: Backend, method: str, path: str, info: RequestInfo) -> Response:
        """A body-less call to one given backend (a stored response, by id)."""
        ...


class UsageLedger(Protocol):
    """The usage ledger (:class:`gateway.tenants.ledger.Ledger`) as the control plane reaches it through the state:
    named by its shape, since tenants/ sits above core. A row is a ``gateway.tenants.ledger.UsageRow``, a query a
    ``gateway.tenants.usage_query.UsageQuery``."""

    def record(self, row: Any) -> None:
        """Keep one request's row (a worker process's too) for the ledger's writer: no I/O."""
        ...

    async def read(self, query: Any) -> list[dict[str, Any]] | None:
        """The totals ``query`` asks for (None: no usage database)."""
        ...


@dataclass
class GatewayState:
    settings: GatewaySettings
    registry: Registry
    metrics: Metrics
    proxy: Forwarder | None = None  # set by the lifespan (it owns the upstream session)
    probes: HealthProbes | None = None  # set by the lifespan (it owns the probes' client)
    quarantine: Quarantine = field(default_factory=Quarantine)  # requests suspected of crashing an engine
    # stored responses -> the engine holding them and their owner; the lifespan opens the one in gateway.state_dir
    responses: ResponseIndex = field(default_factory=ResponseIndex)
    peers: Peers | None = None  # set in the control process of worker processes: a drain counts their requests too
    ledger: UsageLedger | None = None  # the usage ledger (set by the app factory, started and closed by the lifespan)
    events: EventLog = field(default_factory=EventLog)  # the last reloads, swaps and restarts (status page, admin API)
    shared_store: SharedStore | None = None  # replicas sharing a store (gateway.replicas.shared): set by the lifespan
    # SIGTERM with gateway.shutdown_delay_s: /ready answers 503 and responses close their connection, while every
    # request is still served (gateway.server); a worker process hears it from its control process
    draining: bool = False

    def in_flight(self, model: str | None, backend: Backend) -> int:
        """Requests on ``backend`` of ``model`` now: this process's and, with worker processes, theirs."""
        here = backend.in_flight
        return here + self.peers.in_flight(model, backend.identity) if self.peers is not None and model is not None else here

    def adapter_in_flight(self, model: str, adapter: str, backend: Backend) -> int:
        """Requests on ``backend`` for the adapter ``<model>:<adapter>`` now, this process's and its workers'."""
        here = sum(1 for selected in backend.adapters_in_flight() if selected == adapter)
        return here + (self.peers.in_flight(f"{model}:{adapter}", backend.identity) if self.peers is not None else 0)
