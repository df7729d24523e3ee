"""Where requests go: one class per kind of upstream, sharing what every upstream counts.

A :class:`Backend` counts its own in-flight requests (so that a swap can drain it before stopping it), keeps
the shapes of requests lost with it (the watchdog's crash suspects) and carries the failure that takes it out
of rotation. What differs by kind is how it is reached and why it may be down:

- :class:`EngineBackend`: an SGLang engine the gateway launched (its :class:`~launch.process.EngineProcess`);
- :class:`UrlBackend`: an engine someone else runs, at a configured URL with an optional key;
- :class:`RouterBackend`: SGLang's router the gateway runs in front of a model's replicas;
- :class:`~gateway.control.snapshot.RemoteBackend`: any of these as a worker process sees it.
"""

from __future__ import annotations

import collections
import secrets
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from launch.grammar_cost import measurable_tokenizer
from launch.model_info import vocab_size as model_vocab_size
from launch.process import EngineProcess, bearer
from launch.router import RouterProcess
from launch.sglang_versions import NEWEST, VERSIONS, EngineVersion, installed_sglang


@dataclass(frozen=True)
class GrammarTokenizer:
    """What the grammar compile budget measures a model's grammars against (gateway.data.grammar_costs): its
    tokenizer's local directory, its vocabulary size, and whether its engine lets JSON carry free whitespace."""

    path: str
    vocab_size: int | None
    any_whitespace: bool


COMPLETED_SHAPES = 4096  # per backend: a steady client's shape stays among them however many others complete between


class Backend:
    """What every upstream has: the name it serves the model under, its replica number and its counts."""

    kind: ClassVar[str] = "backend"  # "engine", "url" or "router": what /admin lists

    def __init__(self, served_name: str, *, replica: int = 0, vocab_size: int | None = None) -> None:
        self.served_name = served_name
        self.replica = replica  # its place among the model's replicas (kept across restarts and swaps)
        self.in_flight = 0
        self.context_length: int | None = None
        self.last_health: bool | None = None  # result of the latest /health probe (external backends)
        # Set while this backend must not take requests although its process may run: being
        # drained by a stop-first swap, or found dead/unhealthy by the watchdog.
        self.failure: str | None = None
        self.retry_after_s: int | None = None  # Retry-After for 503s caused by ``failure``
        # Asleep by design (residency): a request wakes it. Its engine is stopped (DormantBackend) or, with SGLang's
        # memory saver, running with its GPU memory released; the watchdog leaves it alone either way.
        self.asleep = False
        self.created_at = time.time()
        self._vocab_size = vocab_size
        # The SGLang version it runs, when known (a launched engine's installed one; an external engine's as its
        # /get_server_info says): which request fields it takes (launch.sglang_versions). Unknown: the newest's.
        self.sglang_version: str | None = None
        # (known, its engine's --tool-call-parser): None runs none, so tool calls would come back as text. Known for a
        # launched engine (its config) and an external one once its /get_server_info said; a router's: not checked.
        self._tool_parser: tuple[bool, str | None] = (False, None)
        # Shapes of requests whose upstream connection broke (the engine died under them, most
        # likely): the watchdog turns them into suspects when it finds the engine dead.
        self.lost: collections.deque[tuple[str, str | None, bool]] = collections.deque(maxlen=64)  # (shape, key, completed)
        # Shapes of requests it answered in full, the most recent last: a suspect of such a shape is not evidence
        # (gateway.core.poison: a shape that crashes an engine does so whenever it comes).
        self.completed: collections.OrderedDict[str, None] = collections.OrderedDict()
        # The requests upstream now (their leases): the suspects if the engine freezes.
        self.active: set[Any] = set()
        # Requests that left before their answer while their engine work could go on (a grammar compile, a long
        # prompt's prefill), with when they left: suspects of a freeze for LINGER_S after (gateway.core.poison).
        self.lingering: collections.deque[tuple[float, tuple[str, str | None, bool]]] = collections.deque(maxlen=64)
        self._token = secrets.token_hex(8)
        # What its grammars are measured against (an external engine's: once its /get_server_info said), else why not.
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self.grammar_tokenizer_missing = "the engine's tokenizer is not known to the gateway"
        self.server_info_asked = False  # /get_server_info was asked (an external engine's facts: HealthProbes.learn_version)

    def note_completed(self, shape: str) -> None:
        """A request of ``shape`` was answered in full (the newest ``COMPLETED_SHAPES`` are kept)."""
        completed = self.completed
        if shape in completed:
            completed.move_to_end(shape)
            return
        completed[shape] = None
        if len(completed) > COMPLETED_SHAPES:
            completed.popitem(last=False)

    def note_lingering(self, suspicion: tuple[str, str | None, bool]) -> None:
        """A request whose engine work may outlive it left before its answer (see :attr:`lingering`)."""
        self.lingering.append((time.monotonic(), suspicion))

    def suspects(self, linger_s: float) -> list[tuple[str, str | None, bool]]:
        """The suspects if this engine froze now: every request upstream, and those that left in the last ``linger_s``
        seconds while their engine work could go on."""
        now = time.monotonic()
        active = [suspicion for lease in list(self.active) if (suspicion := lease.suspect()) is not None]
        return active + [suspicion for left, suspicion in self.lingering if now - left <= linger_s]

    def adapters_in_flight(self) -> list[str]:
        """The LoRA adapter of each request upstream now that selects one (an unload waits for them)."""
        return [lease.adapter for lease in self.active if lease.adapter is not None]

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def identity(self) -> str:
        """Which upstream this is, as the persistent response index records it (see :mod:`gateway.core.responses_index`).

        An engine or router the gateway runs is named by a random token of this object: a restarted or
        replaced one has lost its memory (and may come back on the same port), so what it stored is gone.
        An external engine is named by its URL (:class:`UrlBackend`).
        """
        return f"{self.kind}:{self._token}"

    @property
    def managed(self) -> bool:
        """True for an engine process the gateway launched (and so may restart, swap and stop)."""
        return False

    @property
    def is_router(self) -> bool:
        """True for SGLang's router in front of a model's replicas (it answers for workers the gateway cannot see)."""
        return False

    @property
    def sends_at_once(self) -> bool:
        """True when the upstream sets ``TCP_NODELAY`` (its small writes never wait for the gateway's ACK)."""
        return False

    @property
    def schedules_by_priority(self) -> bool:
        """True when the engine orders its queue by each request's ``priority`` (SGLang's priority scheduling)."""
        return False

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (token ids must be below it), when known."""
        return self._vocab_size

    @property
    def knows_tool_parser(self) -> bool:
        """Whether :attr:`tool_call_parser` is known (tools are refused only where the engine is known to have none)."""
        return self._tool_parser[0]

    @property
    def tool_call_parser(self) -> str | None:
        """The engine's tool-call parser (None: none, or not known)."""
        return self._tool_parser[1]

    def learn_tool_parser(self, parser: str | None) -> None:
        """What the engine said of its tool-call parser (None: it runs none)."""
        self._tool_parser = (True, parser)

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer | None:
        """The tokenizer its grammars' compile cost is measured against (None: not measured, for the reason in
        :attr:`grammar_tokenizer_missing`)."""
        return self._grammar_tokenizer

    def learn_grammar_backend(self, info: dict[str, Any]) -> None:
        """What an SGLang server's ``/get_server_info`` says of its grammar backend and tokenizer: measured against
        the tokenizer when it is on this machine and the backend is xgrammar (SGLang's default)."""
        path = info.get("tokenizer_path") or info.get("model_path")
        found, self.grammar_tokenizer_missing = measurable_tokenizer(info.get("grammar_backend"), path if isinstance(path, str) else None)
        if found is not None:
            vocab = self._vocab_size or model_vocab_size(found)
            whitespace = not info.get("constrained_json_disable_any_whitespace", False)
            self._grammar_tokenizer = GrammarTokenizer(found, vocab, whitespace)

    @property
    def engine_version(self) -> EngineVersion:
        """The version table's entry for :attr:`sglang_version` (the newest's for an unknown or unlisted one)."""
        return VERSIONS.get(self.sglang_version or NEWEST) or VERSIONS[NEWEST]

    def upstream_headers(self) -> dict[str, str]:
        """Headers every upstream call of this backend carries (the upstream's API key, if any)."""
        return {}

    def unavailable_reason(self) -> str | None:
        """Why requests cannot go upstream now (a failure set on it, asleep, or its process down), else None."""
        if self.failure is not None:
            return self.failure
        if self.asleep:
            return "asleep (its engine wakes at the next request)"
        return self._process_problem()

    def _process_problem(self) -> str | None:
        return None

    def describe(self) -> str:
        where = self._where()
        return f"{where} (replica {self.replica})" if self.replica else where

    def _where(self) -> str:
        return f"{self.kind} at {self.url}"


class EngineBackend(Backend):
    """An SGLang engine the gateway launched: reached at the port it learned when it started, with its own key."""

    kind = "engine"

    def __init__(self, served_name: str, engine: EngineProcess, *, replica: int = 0) -> None:
        super().__init__(served_name, replica=replica)
        self.engine = engine

    @property
    def knows_tool_parser(self) -> bool:
        return True  # its config says

    @property
    def tool_call_parser(self) -> str | None:
        return self.engine.config.tool_call_parser

    @property
    def engine_version(self) -> EngineVersion:
        """The version installed for the engine's python, read once (the launcher asked already: cached)."""
        if self.sglang_version is None:
            self.sglang_version = installed_sglang(self.engine.config.python_executable)
        return super().engine_version

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer | None:
        """Its config's tokenizer (or model) directory, when it is local and the grammar backend xgrammar (looked up
        once found: a hub model's files are in the local cache only after the engine downloaded them)."""
        if self._grammar_tokenizer is None:
            config = self.engine.config
            found, self.grammar_tokenizer_missing = measurable_tokenizer(config.grammar_backend, config.tokenizer_path or config.model_path)
            if found is not None:
                self._grammar_tokenizer = GrammarTokenizer(found, self.vocab_size, not config.json_disable_any_whitespace)
        return self._grammar_tokenizer

    @property
    def url(self) -> str:
        return self.engine.url  # read at request time: a managed engine learns its port when it starts

    @property
    def managed(self) -> bool:
        return True

    @property
    def sends_at_once(self) -> bool:
        return True  # SGLang's server sets TCP_NODELAY

    @property
    def schedules_by_priority(self) -> bool:
        return self.engine.config.enable_priority_scheduling

    @property
    def vocab_size(self) -> int | None:
        """Read from the model's files once found (a hub model's ``config.json`` is in the local cache only
        after the engine downloaded it)."""
        if self._vocab_size is None:
            self._vocab_size = model_vocab_size(self.engine.config.model_path)
        return self._vocab_size

    def upstream_headers(self) -> dict[str, str]:
        return self.engine.auth_headers()  # the engine's own random key (see EngineProcess.api_key)

    def _process_problem(self) -> str | None:
        if not self.engine.running:
            code = self.engine.returncode
            return "engine is not running" + (f" (exit code {code})" if code is not None else "")
        if not self.engine.ready:
            return f"engine is not ready ({self.engine.phase})"
        return None

    def _where(self) -> str:
        return f"engine {self.engine.name} at {self.url}"


class DormantBackend(Backend):
    """The place of an engine that is not running by design (residency: on demand, stopped when idle): a request
    for its model wakes it (:mod:`gateway.control.residency`); the watchdog has nothing to restart."""

    kind = "dormant"

    def __init__(self, served_name: str, *, replica: int = 0) -> None:
        super().__init__(served_name, replica=replica)
        self.asleep = True

    @property
    def url(self) -> str:
        return ""

    def _where(self) -> str:
        return "no engine (asleep)"


class UrlBackend(Backend):
    """An engine someone else runs (a ``url:`` model, or a replica of a served MLflow model)."""

    kind = "url"

    def __init__(
        self, served_name: str, url: str, *, api_key: str | None = None, vocab_size: int | None = None, replica: int = 0,
        priority_scheduling: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(served_name, replica=replica, vocab_size=vocab_size)
        self._url = url
        self.api_key = api_key  # sent upstream as a bearer token; never logged or listed
        self._priority_scheduling = priority_scheduling  # the config says so: the gateway cannot ask the server

    @property
    def schedules_by_priority(self) -> bool:
        return self._priority_scheduling

    @property
    def url(self) -> str:
        return self._url

    @property
    def identity(self) -> str:
        return f"url:{self._url}"  # it outlives the gateway, and so do the responses it stores

    def upstream_headers(self) -> dict[str, str]:
        return bearer(self.api_key)

    def _where(self) -> str:
        return f"external {self.url}"


class RouterBackend(Backend):
    """SGLang's router the gateway runs in front of a model's replicas (it may wait for ACKs: not TCP_NODELAY)."""

    kind = "router"

    def __init__(self, served_name: str, router: RouterProcess, *, api_key: str | None = None) -> None:
        super().__init__(served_name)
        self.router = router
        self.api_key = api_key

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def is_router(self) -> bool:
        return True

    def upstream_headers(self) -> dict[str, str]:
        return bearer(self.api_key)

    def _process_problem(self) -> str | None:
        if not self.router.running:
            return f"its router is not running (exit code {self.router.returncode})"
        return None
