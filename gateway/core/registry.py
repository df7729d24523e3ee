"""Which backend serves which model name: the one mutable piece of routing state.

A :class:`~gateway.core.backends.Backend` is where requests go (see :mod:`gateway.core.backends`).
A :class:`ModelRoute` binds a model name, its aliases, its limiter and its backends: one per replica
(``replicas: N`` engines of one engine section; a ``url:`` model has one), numbered by ``Backend.replica``.
The :class:`Registry` maps every name and alias to a route through an immutable snapshot that is
replaced in one assignment (atomic for the event loop): readers never see a half-applied change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from gateway.config import GatewaySettings, LimitSettings
from gateway.core.backends import Backend, EngineBackend, UrlBackend
from gateway.core.limits import ConcurrencyLimiter
from launch.config import DeploymentConfig, ModelEntry
from launch.process import EngineProcess


@dataclass
class ModelRoute:
    """One model as clients see it (``replicas`` may be given as a single backend)."""

    name: str
    replicas: tuple[Backend, ...]
    aliases: tuple[str, ...] = ()
    limiter: ConcurrencyLimiter = field(default_factory=lambda: ConcurrencyLimiter(LimitSettings()))
    drained: bool = False  # set by the admin API: new requests get 503 until undrained
    front: Backend | None = None  # SGLang's router in front of the replicas, when the model asks for one
    adapters: tuple[str, ...] = ()  # LoRA adapters its engines serve, each the model "<name>:<adapter>"
    adapter_aliases: tuple[tuple[str, str], ...] = ()  # (alias, adapter): another name of "<name>:<adapter>"

    def __post_init__(self) -> None:
        if isinstance(self.replicas, Backend):
            self.replicas = (self.replicas,)

    @property
    def backend(self) -> Backend:
        """The first replica (the only backend of most models)."""
        return self.replicas[0]

    @property
    def names(self) -> tuple[str, ...]:
        """Every name clients may use: the model's, its aliases, ``<name>:<adapter>`` for each adapter and the
        aliases of the adapters served now."""
        return (self.name, *self.aliases, *self.adapter_names)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        served = tuple(f"{self.name}:{adapter}" for adapter in self.adapters)
        return served + tuple(alias for alias, adapter in self.adapter_aliases if adapter in self.adapters)

    def adapter_for(self, requested: object) -> str | None:
        """The adapter a request for model ``requested`` selects (None: the base model)."""
        if not isinstance(requested, str):
            return None
        if requested.startswith(self.name + ":"):
            adapter = requested[len(self.name) + 1 :]
            return adapter if adapter in self.adapters else None
        for alias, adapter in self.adapter_aliases:
            if requested == alias:
                return adapter if adapter in self.adapters else None
        return None

    def backend_named(self, identity: str) -> Backend | None:
        """The replica (or the router in front) whose :attr:`Backend.identity` is ``identity``, if still there."""
        for backend in (*self.replicas, self.front):
            if backend is not None and backend.identity == identity:
                return backend
        return None

    @property
    def asleep(self) -> bool:
        """Its engine is stopped by design (residency): a request wakes it. (A loop, not ``all()`` over a generator:
        asked for every request, whose awake engine would close the generator with an exception.)"""
        for backend in self.replicas:
            if not backend.asleep:
                return False
        return True

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
            backend: Backend = EngineBackend(entry.engine.served_model_name or name, engines[name])
        else:
            backend = url_backend(name, entry)
        limiter = ConcurrencyLimiter(settings.limits_for(name))
        routes.append(ModelRoute(name, backend, tuple(entry.aliases), limiter, adapters=tuple(entry.adapters), adapter_aliases=adapter_aliases(entry)))
    return Registry(routes)


def adapter_aliases(entry: ModelEntry) -> tuple[tuple[str, str], ...]:
    """A route's (alias, adapter) pairs, from the entry's ``adapter_aliases``."""
    return tuple(entry.adapter_aliases.items())


def url_backend(name: str, entry: ModelEntry) -> UrlBackend:
    """The backend of a ``url:`` model: its upstream name defaults to the model's name here."""
    assert entry.url is not None
    return UrlBackend(
        entry.served_model_name or name, entry.url, api_key=entry.api_key, vocab_size=entry.vocab_size,
        priority_scheduling=entry.enable_priority_scheduling,
    )  # fmt: skip


def with_url_replicas(route: ModelRoute, upstreams: Sequence[tuple[str, str | None]]) -> ModelRoute:
    """``route`` with one url backend per (base URL, API key) in ``upstreams``, numbered in order: engines
    run by someone else (the replicas of a served MLflow model), balanced like an engine section's replicas."""
    first = route.backend
    backends = tuple(
        UrlBackend(
            first.served_name, url, api_key=api_key, vocab_size=first.vocab_size, replica=index,
            priority_scheduling=first.schedules_by_priority,
        )  # fmt: skip
        for index, (url, api_key) in enumerate(upstreams)
    )
    return replace(route, replicas=backends)
