"""The ``openai`` client every flavour calls, bound to one served model: the engines this package runs
(one, or one per replica; see :mod:`model_code.engine_owner`) or a server reached at a URL;
:class:`LogTimeClient` stands in for it while MLflow logs the model (it validates requests exactly like
the real client and answers a placeholder).

Errors are the typed :mod:`model_code.errors`. A request whose replica cannot be reached is sent once
more (a stream only if nothing was received yet): to another replica when the model has one that can
take it, else, for a shared engine (restarted by its host, or its host replaced), to the same engine
once it is back. Every request goes through the request guard first (:mod:`model_code.guard`), and a
request under which the engine crashed or froze is never sent again (:mod:`model_code.quarantine`).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
from loguru import logger
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine_guard.shapes import request_shape
from engine_guard.tool_calls import forced_call_problem
from model_code.engine_owner import Engine, acquire_engines
from model_code.errors import BadRequestError, EngineInternalError, EngineUnavailableError, from_openai_error
from model_code.guard import CHAT_PATH, RequestGuard, engine_body
from model_code.params import create_kwargs
from model_code.quarantine import CallQuarantine, took_engine_down
from model_code.replica_set import Replica, ReplicaSet
from model_code.target import LOG_TIME_TEXT, ModelCodeSettings, in_log_time, resolve_target
from model_code.trace_context import outgoing_headers

T = TypeVar("T")


def usage_dict(usage: Any) -> dict[str, int] | None:
    """``{prompt_tokens, completion_tokens, total_tokens}`` from an openai usage object or mapping."""
    if usage is None:
        return None
    if hasattr(usage, "model_dump"):
        data = usage.model_dump()
    elif hasattr(usage, "to_dict"):  # MLflow's dataclasses (TokenUsageStats)
        data = usage.to_dict()
    else:
        data = dict(usage)
    out = {k: int(data[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens") if data.get(k) is not None}
    return out or None


class EngineClient:
    """``openai`` clients bound to one served model: one per replica (an engine this package runs, or the
    URL), the engines it holds, and the choice of a replica per request (:mod:`model_code.replica_set`)."""

    def __init__(
        self, model: str, replicas: ReplicaSet, settings: ModelCodeSettings | None = None, adapters: tuple[str, ...] | None = None,
        guard: RequestGuard | None = None,
    ) -> None:
        self.model = model
        self.replicas = replicas
        self.settings = settings or ModelCodeSettings()
        self.adapters = adapters  # the LoRA adapters a request may select (None: a URL target's server checks)
        self.guard = guard or RequestGuard(model)
        self.quarantine = CallQuarantine(model)
        self._closed = False

    @classmethod
    def from_model_config(
        cls, model_config: Mapping[str, Any] | None, artifacts: Mapping[str, str] | None = None
    ) -> EngineClient | LogTimeClient:
        """Start or join the engines (or connect to the URL); a :class:`LogTimeClient` while MLflow logs the model."""
        target = resolve_target(model_config, artifacts)
        if in_log_time():
            logger.info("model {}: loaded by MLflow's log/save step: no engine is started", target.name)
            guard = RequestGuard.from_target(target, measure_grammars=False)  # the engine's costs are measured where it runs
            return LogTimeClient(target.served_name, target.settings, target.adapters, guard)
        api_key = target.api_key or "EMPTY"
        if target.settings.api_key_env:
            api_key = os.environ.get(target.settings.api_key_env, api_key)
        if target.url is not None:
            replicas = [Replica(0, target.url, api_key, target.settings)]
        else:
            engines = acquire_engines(target)
            replicas = [
                Replica(index, engine.url, engine.api_key or api_key, target.settings, engine)
                for index, engine in enumerate(engines)
            ]
        guard = RequestGuard.from_target(target)
        return cls(target.served_name, ReplicaSet(replicas), target.settings, target.adapters, guard)

    @property
    def engines(self) -> list[Engine]:
        """The engines this client holds, in replica order (empty for a URL target)."""
        return [replica.engine for replica in self.replicas.replicas if replica.engine is not None]

    @property
    def engine(self) -> Engine | None:
        """The first replica's engine (the only one of most models), or None for a URL target."""
        return self.replicas.replicas[0].engine

    @property
    def upstreams(self) -> list[tuple[str, str]]:
        """(base URL ending in ``/v1``, API key) of each replica, in replica order."""
        return [(replica.base_url, replica.api_key) for replica in self.replicas.replicas]

    @property
    def base_url(self) -> str:
        return self.replicas.replicas[0].base_url

    @property
    def api_key(self) -> str:
        return self.replicas.replicas[0].api_key

    def request(
        self, params: Mapping[str, Any] | None, messages: list[dict[str, Any]] | None = None, *, stream: bool = False
    ) -> dict[str, Any]:
        """The ``chat.completions.create`` kwargs of ``params``, ``model`` included (an adapter's name when one is
        selected), checked by the request guard with ``messages`` (a placeholder message when not known yet)."""
        return guarded_request(self.model, self.adapters, self.settings, self.guard, params, messages, stream)

    def chat_body(self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The JSON body :meth:`chat` sends for ``messages`` and ``params``, checked by the guard: a batch line's
        body, so a job handed to the gateway asks exactly what the direct calls would."""
        return engine_body(messages, self.request(params, messages))

    def chat(self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None) -> ChatCompletion:
        """One non-streaming completion through the ``openai`` SDK (its typed model); typed errors."""
        kwargs = self.request(params, messages)

        def send(replica: Replica) -> ChatCompletion:
            create = replica.openai().chat.completions.create
            return create(messages=messages, extra_headers=outgoing_headers(), **kwargs)

        body = engine_body(messages, kwargs)
        completion = self._completion(body, send)
        _check_forced_call(body, completion.model_dump(exclude_unset=True))
        return completion

    def chat_json(self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """One non-streaming completion as the engine's JSON (a dict), through the lean transport
        (:mod:`model_code.lean`: no pydantic models); the same request, retries and typed errors as :meth:`chat`."""
        body = engine_body(messages, self.request(params, messages))
        answer = self._completion(body, lambda replica: replica.lean().post(body, outgoing_headers()))
        _check_forced_call(body, answer)
        return answer

    def stream(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None
    ) -> Iterator[ChatCompletionChunk]:
        """Engine chunks as they arrive through the ``openai`` SDK (usage in the last one); typed errors, also mid-stream."""
        kwargs = self.request(params, messages, stream=True)

        def send(replica: Replica) -> Iterator[ChatCompletionChunk]:
            create = replica.openai().chat.completions.create
            return create(
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=outgoing_headers(),
                **kwargs,
            )

        yield from self._chunks(engine_body(messages, kwargs, stream=True), send)

    def stream_json(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None
    ) -> Iterator[dict[str, Any]]:
        """Engine chunks as dicts, one ``orjson`` parse each, through the lean transport (:mod:`model_code.lean`);
        the same request, retries and typed errors as :meth:`stream`."""
        body = engine_body(messages, self.request(params, messages, stream=True), stream=True)
        yield from self._chunks(body, lambda replica: replica.lean().stream(body, outgoing_headers()))

    def _completion(self, body: dict[str, Any], send: Callable[[Replica], T]) -> T:
        """``send(replica)`` for the request ``body``: quarantine, one retry elsewhere, typed errors."""
        shape = request_shape(CHAT_PATH, body)
        with self.quarantine.holding(shape):
            replica = self._take()
            for attempt in (1, 2):
                log_file = _log_file(replica)
                try:
                    return self._answered(partial(send, replica))
                except openai.APIConnectionError as error:
                    refused = error
                except openai.OpenAIError as error:
                    raise from_openai_error(error) from error
                finally:
                    self.replicas.release(replica)
                if self._failed_under(shape, refused, replica, log_file):
                    raise from_openai_error(refused) from refused
                following = self._retry_after(replica, refused) if attempt == 1 else None
                if following is None:
                    raise from_openai_error(refused) from refused
                replica = following
        raise AssertionError("unreachable")

    def _chunks(self, body: dict[str, Any], send: Callable[[Replica], Iterator[T]]) -> Iterator[T]:
        """The chunks of ``send(replica)`` (a stream that can be closed) for the request ``body``: quarantine, one
        retry elsewhere while nothing was received, typed errors, also mid-stream."""
        shape = request_shape(CHAT_PATH, body)
        with self.quarantine.holding(shape):
            replica = self._take()
            for attempt in (1, 2):
                received = False
                log_file = _log_file(replica)
                try:
                    with closing(self._answered(partial(send, replica))) as stream:  # type: ignore[type-var]
                        for chunk in stream:
                            received = True
                            yield chunk
                    return
                except openai.APIConnectionError as error:
                    refused = error
                except httpx.TransportError as error:  # the connection broke mid-stream (the openai client passes it on)
                    self._failed_under(shape, error, replica, log_file)
                    raise EngineUnavailableError(f"the engine's connection broke mid-stream: {error}") from error
                except openai.OpenAIError as error:
                    raise from_openai_error(error) from error
                finally:
                    self.replicas.release(replica)
                if self._failed_under(shape, refused, replica, log_file):
                    raise from_openai_error(refused) from refused
                following = None if received or attempt == 2 else self._retry_after(replica, refused)
                if following is None:
                    raise from_openai_error(refused) from refused
                replica = following

    def _answered(self, call: Callable[[], T]) -> T:
        """``call()``, sent again (``max_retries`` times, with backoff) while the engine answers 429 or 5xx: an
        engine that answers is alive, so this never resends a request it crashed or froze under."""
        for retry in range(self.settings.max_retries + 1):
            try:
                return call()
            except openai.APIStatusError as error:
                if retry == self.settings.max_retries or not (error.status_code == 429 or error.status_code >= 500):
                    raise
                time.sleep(min(0.5 * 2**retry, 8.0))
        raise AssertionError("unreachable")

    def _failed_under(self, shape: str, error: BaseException, replica: Replica, log_file: Path | None) -> bool:
        """Whether the engine crashed or froze under this call (then noted in the quarantine, and the call is
        never sent again); ``log_file``: the engine's log when the call was sent (a restart writes another)."""
        if not took_engine_down(error, has_engine=replica.engine is not None, log_file=log_file):
            return False
        refused = self.quarantine.engine_failed(shape)
        logger.warning(
            "model {}: the engine failed under a call ({}); not retried{}", self.model, type(error.__cause__ or error).__name__,
            "; calls of its shape are refused from now on" if refused else "",
        )
        return True

    def _take(self) -> Replica:
        """The replica for a new request (counted in flight); EngineUnavailableError when none can take it."""
        if self._closed:
            raise EngineUnavailableError(f"model {self.model!r}: the client was closed")
        replica = self.replicas.take()
        if replica is None:
            raise EngineUnavailableError(self.replicas.unavailable(self.model))
        return replica

    def _retry_after(self, refused: Replica, error: openai.APIConnectionError) -> Replica | None:
        """Where the one retry of a request ``refused`` could not connect to goes (counted in flight), or None.

        Another replica when one can take it (a shared engine that refused waits for its host's restart in
        the background, out of the rotation); else the same shared engine once it answers again.
        """
        if isinstance(error, openai.APITimeoutError) or self._closed:
            return None
        other = self.replicas.take(exclude=refused)
        if other is not None:
            logger.warning(
                "model {}: replica {} cannot be reached ({}); sent to replica {}",
                self.model,
                refused.index,
                error,
                other.index,
            )
            refused.recover_in_background()
            return other
        if not refused.shared:
            return None
        logger.warning("model {}: the engine is unreachable ({}); waiting for it to be back", self.model, error)
        return self.replicas.hold(refused) if refused.recover() else None

    def close(self) -> None:
        """Stop (or stop using) every replica's engine and close the HTTP clients. Idempotent."""
        self._closed = True
        self.replicas.close()
        self.guard.close()


class LogTimeClient:
    """Stands in for the engine while MLflow logs the model: validates requests, answers a placeholder."""

    engine = None

    def __init__(
        self, model: str, settings: ModelCodeSettings | None = None, adapters: tuple[str, ...] | None = None,
        guard: RequestGuard | None = None,
    ) -> None:
        self.model = model
        self.settings = settings or ModelCodeSettings()
        self.adapters = adapters
        self.guard = guard or RequestGuard(model)

    def request(
        self, params: Mapping[str, Any] | None, messages: list[dict[str, Any]] | None = None, *, stream: bool = False
    ) -> dict[str, Any]:
        """The ``chat.completions.create`` kwargs of ``params``, ``model`` included (an adapter's name when one is
        selected), checked by the request guard with ``messages`` (a placeholder message when not known yet)."""
        return guarded_request(self.model, self.adapters, self.settings, self.guard, params, messages, stream)

    def chat(self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None) -> ChatCompletion:
        _check_messages(messages)
        self.request(params, messages)
        return ChatCompletion.model_validate(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": LOG_TIME_TEXT}}
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )

    def stream(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None
    ) -> Iterator[ChatCompletionChunk]:
        _check_messages(messages)
        self.request(params, messages, stream=True)
        base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model,
        }
        yield ChatCompletionChunk.model_validate(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": LOG_TIME_TEXT}, "finish_reason": None}
                ],
            }
        )
        yield ChatCompletionChunk.model_validate(
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        )

    def chat_json(self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self.chat(messages, params).model_dump(exclude_unset=True)

    def stream_json(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None
    ) -> Iterator[dict[str, Any]]:
        for chunk in self.stream(messages, params):
            yield chunk.model_dump(exclude_unset=True)

    def close(self) -> None:
        pass


def _check_forced_call(body: dict[str, Any], answer: dict[str, Any]) -> None:
    """A forced tool choice answered without a call is an error (as the gateway's 502 ``forced_call_missing``), never
    an answer with nothing for the agent to do."""
    problem = forced_call_problem(CHAT_PATH, body, answer)
    if problem is not None:
        raise EngineInternalError(f"forced_call_missing: {problem}", body=answer)


def _log_file(replica: Replica) -> Path | None:
    """The log of the engine a call is sent to (None for a URL): where a crash under the call is written."""
    return replica.engine.log_file if replica.engine is not None else None


_PLACEHOLDER_MESSAGES = [{"role": "user", "content": "."}]


def guarded_request(
    model: str, adapters: tuple[str, ...] | None, settings: ModelCodeSettings, guard: RequestGuard,
    params: Mapping[str, Any] | None, messages: list[dict[str, Any]] | None, stream: bool,
) -> dict[str, Any]:
    """``chat.completions.create`` kwargs of ``params`` (``model`` included), checked by ``guard`` with ``messages``."""
    kwargs = create_kwargs(model, adapters, params, settings.defaults)
    guard.check(messages if messages is not None else _PLACEHOLDER_MESSAGES, kwargs, stream=stream)
    return kwargs


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise BadRequestError("no messages")
