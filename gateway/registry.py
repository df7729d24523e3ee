"""Which backend serves which model name: the one mutable piece of routing state.

A :class:`Backend` is where requests go (a managed :class:`EngineProcess` or an external URL) and
counts its own in-flight requests, so that a later blue-green swap can drain the old backend before
stopping it. A :class:`ModelRoute` binds a model name, its aliases, its backend and its limiter.
The :class:`Registry` maps every name and alias to a route through an immutable snapshot that is
replaced in one assignment (atomic for the event loop): readers never see a half-applied change.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gateway.config import GatewaySettings, LimitSettings
from gateway.limits import ConcurrencyLimiter
from launch.config import DeploymentConfig
from launch.process import EngineProcess


class Backend:
    """An upstream SGLang server (or router) and the name it serves the model under."""

    def __init__(self, served_name: str, *, engine: EngineProcess | None = None, url: str | None = None) -> None:
        if (engine is None) == (url is None):
            raise ValueError("a backend has either an engine or a url")
        self.served_name = served_name
        self.engine = engine
        self._url = url
        self.in_flight = 0
        self.context_length: int | None = None
        self.last_health: bool | None = None  # result of the latest /health probe (external backends)
        self.created_at = time.time()

    @property
    def managed(self) -> bool:
        return self.engine is not None

    @property
    def url(self) -> str:
        # Read at request time: a managed engine learns its port when it starts.
        return self.engine.url if self.engine is not None else self._url  # type: ignore[return-value]

    def unavailable_reason(self) -> str | None:
        """Why requests cannot go upstream now (managed engine not running / not ready), else None."""
        if self.engine is None:
            return None
        if not self.engine.running:
            code = self.engine.returncode
            return "engine is not running" + (f" (exit code {code})" if code is not None else "")
        if not self.engine.ready:
            return f"engine is not ready ({self.engine.phase})"
        return None

    def describe(self) -> str:
        return f"engine {self.engine.name} at {self.url}" if self.engine else f"external {self.url}"


@dataclass
class ModelRoute:
    """One model as clients see it."""

    name: str
    backend: Backend
    aliases: tuple[str, ...] = ()
    limiter: ConcurrencyLimiter = field(default_factory=lambda: ConcurrencyLimiter(LimitSettings()))

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


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

    def resolve(self, name: str) -> ModelRoute | None:
        return self._by_name.get(name)

    def routes(self) -> tuple[ModelRoute, ...]:
        return self._routes

    def names(self) -> list[str]:
        return list(self._by_name)

    def backends(self) -> list[Backend]:
        return list({id(route.backend): route.backend for route in self._routes}.values())


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
            backend = Backend(name, url=entry.url)
        routes.append(ModelRoute(name, backend, tuple(entry.aliases), ConcurrencyLimiter(settings.limits_for(name))))
    return Registry(routes)
