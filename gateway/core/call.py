"""One proxied request as its stages see it: built once at the edge, carried through admission, the exchange and
the answer (:mod:`gateway.data.proxy`), and by the stream that waits for an asleep model (:mod:`gateway.data.waking`).

What the stages tell the request's trace goes through :class:`TraceNotes`, one hook: the base class notes
nothing (tracing off, or a route that is not traced), :class:`gateway.core.tracing.Tracing` gives the one that does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.config import BalancingSettings

if TYPE_CHECKING:
    from starlette.types import Receive

    from gateway.core.backends import Backend
    from gateway.core.context import RequestInfo
    from gateway.core.endpoints import ProxiedRoute
    from gateway.core.registry import ModelRoute

DEFAULT_BALANCING = BalancingSettings()


class TraceNotes:
    """What a request's stages tell its trace. This base notes nothing: every stage calls it unconditionally."""

    __slots__ = ()

    def request(self, body: dict[str, Any]) -> None:
        """The request's parameters (its body as the client sent it)."""

    def queued(self, since: float) -> None:
        """It waited for its model's slot from ``since`` (a ``time.perf_counter()`` reading) until now."""

    def attempt(self, model: str, url: str, replica: int | None) -> dict[str, str]:
        """An upstream attempt starts now; the headers that give the engine its span's context."""
        return {}

    def attempt_failed(self, error: BaseException) -> None:
        """The attempt under way failed in transport (another may follow)."""

    def answered(self, content: bytes | None, streamed: bool) -> None:
        """The upstream's answer came: a plain one whole (``content``), a stream's head."""


NO_NOTES = TraceNotes()


@dataclass(slots=True, eq=False)
class Call:
    """One proxied request: what the edge resolved (model route, key, priority...) and what its stages decide."""

    route: ModelRoute  # the model's route; the woken one, once an asleep model's engine has started
    endpoint: ProxiedRoute
    body: dict[str, Any]  # as parsed by the guard; ``model`` (and ``priority``) rewritten per attempt
    info: RequestInfo
    owner: str  # the client key's identity (gateway.edge.auth.request_owner): the owner of what it creates
    key: str | None  # the client key that sent it (its name, else its hash; None on an open gateway): whose evidence it is
    receive: Receive | None = None  # the client's ASGI receive (body read): a plain request notices a client leaving
    cycle: Any = None  # under the gateway's own protocol, its cycle (gateway.edge.cycle): says when the client leaves
    balancing: BalancingSettings = DEFAULT_BALANCING
    pinned: Backend | None = None  # the backend that must answer: it holds the state the request continues
    grammar_size: int | None = None  # engine_guard.bounds.grammar_bytes of the body, when the guard measured it
    priority: int | None = None  # its class: its place in the model's queue, and ``priority`` on engines that schedule by it
    notes: TraceNotes = NO_NOTES
    adapter: str | None = None  # the LoRA adapter its model name selects ("<model>:<adapter>")
    streamed: bool = False  # an SSE stream was asked for on a route that streams
    hide_usage: bool = False  # the gateway asked for the stream's usage event; the client did not
    keep_extensions: bool = False  # the client asked for the engine's answer as written (gateway.data.answer_extensions)
