"""The routing state as worker processes receive it: what the control process knows, frozen into plain values.

With ``gateway.workers`` > 1 the engines live in the control process, and each data-plane worker routes from a
:class:`RoutingState` the control sends it: the settings, every model with its aliases and backends (URL,
upstream headers, identity, whether it can take requests now), and the poison quarantine. A worker turns it
into its own :class:`~gateway.core.registry.Registry` of :class:`RemoteBackend` (:func:`apply_state`), and
keeps serving with the last state it has while the control process works.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import GatewaySettings
from gateway.core.backends import Backend, GrammarTokenizer
from gateway.core.limits import ConcurrencyLimiter
from gateway.core.poison import Quarantine, Suspect
from gateway.core.registry import ModelRoute, Registry
from gateway.edge.auth import KeyPolicy


@dataclass(frozen=True)
class BackendView:
    """One backend as a worker routes to it."""

    served_name: str
    url: str
    headers: tuple[tuple[str, str], ...]  # the upstream's key (a managed engine's own random one)
    identity: str  # the control's Backend.identity: stored responses name it, on every worker alike
    replica: int
    vocab_size: int | None
    context_length: int | None
    unavailable: str | None  # why it cannot take requests now (None: it can)
    retry_after_s: int | None
    managed: bool
    is_router: bool
    sends_at_once: bool
    schedules_by_priority: bool = False
    sglang_version: str | None = None
    tool_call_parser: str | None = None
    knows_tool_parser: bool = False
    grammar_tokenizer: GrammarTokenizer | None = None
    grammar_tokenizer_missing: str = ""


@dataclass(frozen=True)
class RouteView:
    name: str
    aliases: tuple[str, ...]
    replicas: tuple[BackendView, ...]
    front: BackendView | None
    drained: bool
    adapters: tuple[str, ...] = ()
    adapter_aliases: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RoutingState:
    settings: GatewaySettings
    keys: KeyPolicy
    routes: tuple[RouteView, ...]
    quarantine: tuple[tuple[tuple[str, str], Suspect], ...]


class RemoteBackend(Backend):
    """A backend that lives in the control process, as a worker sees it: a URL, headers and a state it is told."""

    def __init__(self, view: BackendView) -> None:
        super().__init__(view.served_name, vocab_size=view.vocab_size, replica=view.replica)
        self.view = view
        self.update(view)

    @property
    def url(self) -> str:
        return self.view.url

    def update(self, view: BackendView) -> None:
        """Take the control's newer view of the same backend (same identity), keeping this worker's counts."""
        self.view = view
        self.failure, self.retry_after_s = view.unavailable, view.retry_after_s
        self.sglang_version = view.sglang_version
        self._tool_parser = (view.knows_tool_parser, view.tool_call_parser)
        self._grammar_tokenizer, self.grammar_tokenizer_missing = view.grammar_tokenizer, view.grammar_tokenizer_missing
        if view.context_length is not None:
            self.context_length = view.context_length
        self._headers = dict(view.headers)

    @property
    def identity(self) -> str:
        return self.view.identity

    @property
    def is_router(self) -> bool:
        return self.view.is_router

    @property
    def sends_at_once(self) -> bool:
        return self.view.sends_at_once

    @property
    def schedules_by_priority(self) -> bool:
        return self.view.schedules_by_priority

    @property
    def managed(self) -> bool:
        return self.view.managed

    def upstream_headers(self) -> dict[str, str]:
        return self._headers

    def unavailable_reason(self) -> str | None:
        return self.failure


def backend_view(backend: Backend) -> BackendView:
    return BackendView(
        served_name=backend.served_name, url=backend.url, headers=tuple(backend.upstream_headers().items()),
        identity=backend.identity, replica=backend.replica, vocab_size=backend.vocab_size,
        context_length=backend.context_length, unavailable=backend.unavailable_reason(),
        retry_after_s=backend.retry_after_s, managed=backend.managed, is_router=backend.is_router,
        sends_at_once=backend.sends_at_once, schedules_by_priority=backend.schedules_by_priority,
        sglang_version=backend.engine_version.sglang, tool_call_parser=backend.tool_call_parser,
        knows_tool_parser=backend.knows_tool_parser, grammar_tokenizer=backend.grammar_tokenizer,
        grammar_tokenizer_missing=backend.grammar_tokenizer_missing,
    )  # fmt: skip


def capture_state(settings: GatewaySettings, keys: KeyPolicy, registry: Registry, quarantine: Quarantine) -> RoutingState:
    """What the control process sends its workers now (compared with the last one sent: equal means nothing new)."""
    routes = tuple(
        RouteView(
            name=route.name, aliases=route.aliases, replicas=tuple(backend_view(b) for b in route.replicas),
            front=backend_view(route.front) if route.front is not None else None, drained=route.drained,
            adapters=route.adapters, adapter_aliases=route.adapter_aliases,
        )  # fmt: skip
        for route in registry.routes()
    )
    return RoutingState(settings, keys, routes, tuple(quarantine.records().items()))


def apply_state(state: RoutingState, registry: Registry, quarantine: Quarantine, current: GatewaySettings) -> None:
    """Make a worker's registry and quarantine match ``state``, in one registry assignment.

    A backend the worker already has (same identity) is kept and updated, so its in-flight count and the
    balancer's view survive; a route keeps its limiter unless its limits changed (a limiter counts requests
    in flight: replacing it would forget them).
    """
    known = {
        (route.name, backend.identity): backend
        for route in registry.routes() for backend in (*route.replicas, route.front) if backend is not None
    }  # fmt: skip
    old_routes = {route.name: route for route in registry.routes()}

    def backend(model: str, view: BackendView) -> RemoteBackend:
        existing = known.get((model, view.identity))
        if isinstance(existing, RemoteBackend):
            existing.update(view)
            return existing
        return RemoteBackend(view)

    routes = []
    for view in state.routes:
        limits = state.settings.limits_for(view.name)
        old = old_routes.get(view.name)
        same_limits = old is not None and current.limits_for(view.name) == limits
        limiter = old.limiter if old is not None and same_limits else ConcurrencyLimiter(limits)
        routes.append(
            ModelRoute(
                view.name, tuple(backend(view.name, b) for b in view.replicas), view.aliases, limiter, view.drained,
                backend(view.name, view.front) if view.front is not None else None, view.adapters, view.adapter_aliases,
            )  # fmt: skip
        )
    registry.replace(routes)
    quarantine.restore(dict(state.quarantine))
