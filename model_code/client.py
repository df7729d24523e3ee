"""The ``openai`` client every flavour calls, bound to one served model: an engine this package runs
(see :mod:`model_code.engine_owner`) or a server reached at a URL; :class:`LogTimeClient` stands in for
it while MLflow logs the model (it validates requests exactly like the real client and answers a
placeholder).

Errors are the typed :mod:`model_code.errors`. When a shared engine cannot be reached (restarted by its
host, or its host replaced), the request waits for it to be back and is sent once more: a stream only
if nothing was received yet.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import openai
from loguru import logger
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from launch.shared import SharedEngine
from model_code.engine_owner import Engine, acquire_engine, release_engine, replica_specs
from model_code.errors import BadRequestError, EngineUnavailableError, from_openai_error
from model_code.params import build_request
from model_code.target import LOG_TIME_TEXT, ModelCodeSettings, in_log_time, resolve_target


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


@dataclass
class EngineClient:
    """``openai`` client bound to one served model; holds the engine it uses (None for a URL target)."""

    base_url: str
    model: str
    settings: ModelCodeSettings = field(default_factory=ModelCodeSettings)
    api_key: str = "EMPTY"
    engine: Engine | None = None
    _client: openai.OpenAI | None = None
    _closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_model_config(
        cls, model_config: Mapping[str, Any] | None, artifacts: Mapping[str, str] | None = None
    ) -> EngineClient | LogTimeClient:
        """Start or join the engine (or connect to the URL); a :class:`LogTimeClient` while MLflow logs the model."""
        target = resolve_target(model_config, artifacts)
        if in_log_time():
            logger.info("model {}: loaded by MLflow's log/save step: no engine is started", target.name)
            return LogTimeClient(target.served_name, target.settings)
        api_key = target.api_key or "EMPTY"
        if target.settings.api_key_env:
            api_key = os.environ.get(target.settings.api_key_env, api_key)
        if target.url is not None:
            return cls(_v1(target.url), target.served_name, target.settings, api_key=api_key)
        engine = acquire_engine(target.settings, *replica_specs(target)[0])  # first replica until the set is wired
        return cls(
            _v1(engine.url), target.served_name, target.settings, api_key=engine.api_key or api_key, engine=engine
        )

    @property
    def client(self) -> openai.OpenAI:
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = openai.OpenAI(
                        base_url=self.base_url,
                        api_key=self.api_key,
                        timeout=self.settings.request_timeout_s,
                        max_retries=self.settings.max_retries,
                    )
                client = self._client
        return client

    def request(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        return build_request(params, self.settings.defaults)

    def chat(self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None) -> ChatCompletion:
        """One non-streaming completion; typed errors."""
        kwargs = self.request(params)
        self._check_open()
        for attempt in (1, 2):
            client = self.client
            try:
                return client.chat.completions.create(model=self.model, messages=messages, **kwargs)
            except openai.APIConnectionError as error:
                if attempt == 2 or not self._recovered(client, error):
                    raise from_openai_error(error) from error
            except openai.OpenAIError as error:
                raise from_openai_error(error) from error
        raise AssertionError("unreachable")

    def stream(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None
    ) -> Iterator[ChatCompletionChunk]:
        """Engine chunks as they arrive (usage in the last one); typed errors, also mid-stream."""
        kwargs = self.request(params)
        self._check_open()
        for attempt in (1, 2):
            client = self.client
            received = False
            try:
                stream = client.chat.completions.create(
                    model=self.model, messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
                )
                with stream:
                    for chunk in stream:
                        received = True
                        yield chunk
                return
            except openai.APIConnectionError as error:
                if attempt == 2 or received or not self._recovered(client, error):
                    raise from_openai_error(error) from error
            except openai.OpenAIError as error:
                raise from_openai_error(error) from error

    def _recovered(self, failed: openai.OpenAI, error: openai.APIConnectionError) -> bool:
        """After ``failed`` could not connect: True once the shared engine answers again (URL/key refreshed)."""
        engine = self.engine
        if isinstance(error, openai.APITimeoutError) or not isinstance(engine, SharedEngine) or self._closed:
            return False
        with self._lock:
            if self._client is not failed:
                return True  # another thread already switched to a fresh client
            logger.warning("model {}: the engine is unreachable ({}); waiting for it to be back", self.model, error)
            if not engine.recover():
                return False
            self.base_url, self.api_key = _v1(engine.url), engine.api_key or self.api_key
            self._client = None
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise EngineUnavailableError(f"model {self.model!r}: the client was closed")
        engine = self.engine
        if engine is not None and not isinstance(engine, SharedEngine) and not engine.running:
            raise EngineUnavailableError(
                f"model {self.model!r}: the engine is not running (exit code {engine.returncode}; log: {engine.log_file})"
            )

    def close(self) -> None:
        """Stop (or stop using) the engine and close the HTTP client. Idempotent."""
        self._closed = True
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.engine is not None:
            release_engine(self.engine)


class LogTimeClient:
    """Stands in for the engine while MLflow logs the model: validates requests, answers a placeholder."""

    engine = None

    def __init__(self, model: str, settings: ModelCodeSettings | None = None) -> None:
        self.model = model
        self.settings = settings or ModelCodeSettings()

    def request(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        return build_request(params, self.settings.defaults)

    def chat(self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None) -> ChatCompletion:
        self.request(params)
        _check_messages(messages)
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
        self.request(params)
        _check_messages(messages)
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

    def close(self) -> None:
        pass


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise BadRequestError("no messages")


def _v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"
