"""Which backend serves which model name: the one mutable piece of routing state.

A :class:`Backend` is where requests go (a managed :class:`EngineProcess` or an external URL) and
counts its own in-flight requests, so that a later swap can drain the old backend before stopping it.
A :class:`ModelRoute` binds a model name, its aliases, its limiter and its backends: one per replica
(``replicas: N`` engines of one engine section; a ``url:`` model has one), numbered by ``Backend.replica``.
The :class:`Registry` maps every name and alias to a route through an immutable snapshot that is
replaced in one assignment (atomic for the event loop): readers never see a half-applied change.
"""

from __future__ import annotations

import collections
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from gateway.config import GatewaySettings, LimitSettings
from gateway.core.limits import ConcurrencyLimiter
from launch.config import DeploymentConfig, ModelEntry
from launch.model_info import vocab_size as model_vocab_size
from launch.process import EngineProcess
from launch.router import RouterProcess


class Backend:
    """An upstream SGLang server (or router) and the name it serves the model under."""

    def __init__(
        self,
        served_name: str,
        *,
        engine: EngineProcess | None = None,
        url: str | None = None,
        api_key: str | None = None,
        vocab_size: int | None = None,
        replica: int = 0,
        router: RouterProcess | None = None,
    ) -> None:
        if (engine is None) == (url is None):
            raise ValueError("a backend has either an engine or a url")
        self.served_name = served_name
        self.replica = replica  # its place among the model's replicas (kept across restarts and swaps)
        self.router = router  # set for the SGLang router the gateway runs in front of a model's replicas
        self.engine = engine
        self._url = url
        self.api_key = api_key  # sent upstream as a bearer token; never logged or listed
        self.in_flight = 0
        self.context_length: int | None = None
        self.last_health: bool | None = None  # result of the latest /health probe (external backends)
        # Set while this backend must not take requests although its process may run: being
        # drained by a stop-first swap, or found dead/unhealthy by the watchdog.
        self.failure: str | None = None
        self.retry_after_s: int | None = None  # Retry-After for 503s caused by ``failure``
        self.created_at = time.time()
        self._vocab_size = vocab_size
        # Shapes of requests whose upstream connection broke (the engine died under them, most
        # likely): the watchdog turns them into suspects when it finds the engine dead.
        self.lost: collections.deque[str] = collections.deque(maxlen=64)
        # The requests upstream now (their leases): the suspects if the engine freezes.
        self.active: set[Any] = set()
        self._token = secrets.token_hex(8)

    @property
    def sends_at_once(self) -> bool:
        """True for an engine the gateway launched: SGLang's server sets ``TCP_NODELAY``, so its small writes
        never wait for the gateway's ACK (SGLang's router and unknown servers behind a URL may not)."""
        return self.engine is not None and self.router is None

    @property
    def is_router(self) -> bool:
        """True for SGLang's router in front of a model's replicas (it answers for workers the gateway cannot see)."""
        return self.router is not None

    @property
    def identity(self) -> str:
        """Which upstream this is, as the persistent response index records it (see :mod:`gateway.core.responses_index`).

        An external engine (a ``url:`` model) is named by its URL: it outlives the gateway, and so do the
        responses it stores, which a restarted gateway must still reach. An engine or router the gateway runs
        is named by a random token of this object: a restarted or replaced one has lost its memory (and may
        come back on the same port), so what it stored is gone.
        """
        if self.engine is None and self.router is None:
            return f"url:{self._url}"
        return f"{'router' if self.router is not None else 'engine'}:{self._token}"

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (token ids must be below it), when known.

        A managed engine's is read from its model files, once found (a hub model's ``config.json``
        is in the local cache only after the engine downloaded it); a url model's is configured.
        """
        if self._vocab_size is None and self.engine is not None:
            self._vocab_size = model_vocab_size(self.engine.config.model_path)
        return self._vocab_size

    def upstream_headers(self) -> dict[str, str]:
        """Headers every upstream call of this backend carries (the upstream's API key, if any).

        A managed engine has its own random key (see ``EngineProcess.api_key``); a url backend the
        configured one.
        """
        if self.engine is not None:
            return self.engine.auth_headers()
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def managed(self) -> bool:
        return self.engine is not None

    @property
    def url(self) -> str:
        # Read at request time: a managed engine learns its port when it starts.
        return self.engine.url if self.engine is not None else self._url  # type: ignore[return-value]

    def unavailable_reason(self) -> str | None:
        """Why requests cannot go upstream now (managed engine not running / not ready), else None."""
        if self.failure is not None:
            return self.failure
        if self.router is not None and not self.router.running:
            return f"its router is not running (exit code {self.router.returncode})"
        if self.engine is None:
            return None
        if not self.engine.running:
            code = self.engine.returncode
            return "engine is not running" + (f" (exit code {code})" if code is not None else "")
        if not self.engine.ready:
            return f"engine is not ready ({self.engine.phase})"
        return None

    def describe(self) -> str:
        where = f"engine {self.engine.name} at {self.url}" if self.engine else f"external {self.url}"
        return f"{where} (replica {self.replica})" if self.replica else where


@dataclass
class ModelRoute:
    """One model as clients see it (``replicas`` may be given as a single backend)."""

    name: str
    replicas: tuple[Backend, ...]
    aliases: tuple[str, ...] = ()
    limiter: ConcurrencyLimiter = field(default_factory=lambda: ConcurrencyLimiter(LimitSettings()))
    drained: bool = False  # set by the admin API: new requests get 503 until undrained
    front: Backend | None = None  # SGLang's router in front of the replicas, when the model asks for one

    def __post_init__(self) -> None:
        if isinstance(self.replicas, Backend):
            self.replicas = (self.replicas,)

    @property
    def backend(self) -> Backend:
        """The first replica (the only backend of most models)."""
        return self.replicas[0]

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def backend_named(self, identity: str) -> Backend | None:
        """The replica (or the router in front) whose :attr:`Backend.identity` is ``identity``, if still there."""
        for backend in (*self.replicas, self.front):
            if backend is not None and backend.identity == identity:
                return backend
        return None

    @property
    def in_flight(self) -> int:
        """Requests of this model in flight (through its router too)."""
        return sum(backend.in_flight for backend in self.replicas) + (self.front.in_flight if self.front is not None else 0)

    def available(self) -> list[Backend]:
        """The replicas that can take a request now."""
        return [backend for backend in self.replicas if backend.unavailable_reason() is None]

    def with_backend(self, backend: Backend) -> ModelRoute:
        """The same route (names, limiter, drain state) with ``backend`` in its replica's place (or added)."""
        replicas = list(self.replicas)
        if backend.replica < len(replicas):
            replicas[backend.replica] = backend
        else:
            replicas.append(backend)
        return replace(self, replicas=tuple(replicas))

    def without_replica(self, replica: int) -> ModelRoute:
        return replace(self, replicas=tuple(b for b in self.replicas if b.replica != replica))


class Registry:
    """Model names and aliases -> routes; swapped as a whole with :meth:`replace`."""

    def __init__(self, routes: Iterable[ModelRoute] = ()) -> None:
        self._by_name: Mapping[str, ModelRoute] = MappingProxyType({})
        self._routes: tuple[ModelRoute, ...] = ()
        self.replace(routes)

    def replace(self, routes: Iterable[ModelRoute]) -> None:
        """Install a new set of routes in one step (names must be unique across routes and aliases)."""
        routes = tuple(routes)
        by_name: dict[str, ModelRoute] = {}
        for route in routes:
            for label in route.names:
                if label in by_name:
                    raise ValueError(f"model name {label!r} is used twice")
                by_name[label] = route
        self._by_name, self._routes = MappingProxyType(by_name), routes

    def put(self, route: ModelRoute) -> None:
        """Install ``route`` in place of the route of the same name (or add it), atomically."""
        kept = [r for r in self._routes if r.name != route.name]
        index = next((i for i, r in enumerate(self._routes) if r.name == route.name), len(kept))
        self.replace([*kept[:index], route, *kept[index:]])

    def set_backend(self, name: str, backend: Backend) -> Backend | None:
        """Put ``backend`` in its replica's place in model ``name``; returns the backend it replaced (or,
        for a replica added, ``backend`` itself); None when there is no such model."""
        route = self._by_name.get(name)
        if route is None or route.name != name:
            return None
        replaced = next((b for b in route.replicas if b.replica == backend.replica), backend)
        self.put(route.with_backend(backend))
        return replaced

    def route(self, name: str) -> ModelRoute | None:
        """The route whose model name (not alias) is ``name``."""
        route = self._by_name.get(name)
        return route if route is not None and route.name == name else None

    def resolve(self, name: str) -> ModelRoute | None:
        return self._by_name.get(name)

    def default_route(self) -> ModelRoute | None:
        """The model answering requests that name none: the one called or aliased ``default``, or the only one."""
        route = self._by_name.get("default")
        if route is None and len(self._routes) == 1:
            route = self._routes[0]
        return route

    def routes(self) -> tuple[ModelRoute, ...]:
        return self._routes

    def names(self) -> list[str]:
        return list(self._by_name)

    def backends(self) -> list[Backend]:
        """Every backend of every route (each once)."""
        return list({id(backend): backend for route in self._routes for backend in route.replicas}.values())


def build_registry(
    deployment: DeploymentConfig, settings: GatewaySettings, engines: Mapping[str, EngineProcess] | None = None
) -> Registry:
    """Routes for every model in ``deployment``; managed models use ``engines[name]``."""
    engines = engines or {}
    routes = []
    for name, entry in deployment.models.items():
        if entry.engine is not None:
            if name not in engines:
                raise ValueError(f"model {name!r} has an engine section but no EngineProcess was given")
            backend = Backend(entry.engine.served_model_name or name, engine=engines[name])
        else:
            backend = url_backend(name, entry)
        routes.append(ModelRoute(name, backend, tuple(entry.aliases), ConcurrencyLimiter(settings.limits_for(name))))
    return Registry(routes)


def url_backend(name: str, entry: ModelEntry) -> Backend:
    """The backend of a ``url:`` model: its upstream name defaults to the model's name here."""
    assert entry.url is not None
    return Backend(entry.served_model_name or name, url=entry.url, api_key=entry.api_key, vocab_size=entry.vocab_size)


def with_url_replicas(route: ModelRoute, upstreams: Sequence[tuple[str, str | None]]) -> ModelRoute:
    """``route`` with one url backend per (base URL, API key) in ``upstreams``, numbered in order: engines
    run by someone else (the replicas of a served MLflow model), balanced like an engine section's replicas."""
    first = route.backend
    backends = tuple(
        Backend(first.served_name, url=url, api_key=api_key, vocab_size=first.vocab_size, replica=index)
        for index, (url, api_key) in enumerate(upstreams)
    )
    return replace(route, replicas=backends)
