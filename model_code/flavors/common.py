"""What the flavours share: the engine-backed base class and the conversions every interface needs.

:class:`EngineBacked` holds the engine client's life cycle (started, or connected to a URL, in ``load_context``;
``close``; ``batch``) and the trace policy; the helpers turn interface messages into chat-completions messages,
join streamed tool-call fragments and read usage off stream chunks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from model_code.batch import batch_predict
from model_code.client import EngineClient, LogTimeClient, usage_dict
from model_code.errors import BadRequestError, EngineUnavailableError
from model_code.tracing import TracePolicy, Usage

_CC_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


class ToolCallAccumulator:
    """Joins streamed tool-call deltas (by index) into complete calls."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: Iterable[Any]) -> None:
        """Tool-call deltas of one chunk: dicts (the lean client's) or the openai SDK's objects."""
        for delta in deltas:
            if not isinstance(delta, dict):
                delta = delta.model_dump()
            call = self._calls.setdefault(
                delta["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if delta.get("id"):
                call["id"] = delta["id"]
            function = delta.get("function")
            if function is not None:
                if function.get("name"):
                    call["function"]["name"] += function["name"]
                if function.get("arguments"):
                    call["function"]["arguments"] += function["arguments"]

    def result(self) -> list[dict[str, Any]]:
        calls = []
        for index in sorted(self._calls):
            call = self._calls[index]
            calls.append({**call, "id": call["id"] or f"call_{uuid.uuid4().hex[:24]}"})
        return calls

    def __bool__(self) -> bool:
        return bool(self._calls)


def as_dict(answer: Any) -> dict[str, Any]:
    """An engine completion or chunk as the dict the engine sent: the lean client's dicts pass as they are, the
    openai SDK's models (a client handed in, tests) are dumped once."""
    return answer if isinstance(answer, dict) else answer.model_dump(exclude_unset=True)


def tool_calls_of(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tool calls of an engine completion's message (a dict), as chat-completions dicts."""
    return [
        {
            "id": call.get("id"),
            "type": "function",
            "function": {"name": call["function"].get("name"), "arguments": call["function"].get("arguments")},
        }
        for call in (message.get("tool_calls") or [])
    ]


def cc_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """Interface messages (pydantic models, MLflow dataclasses or dicts) as chat-completions messages."""
    out = []
    for message in messages:
        data = (
            message.model_dump(exclude_none=True)
            if hasattr(message, "model_dump")
            else (message.to_dict() if hasattr(message, "to_dict") else dict(message))
        )
        out.append({k: data[k] for k in _CC_MESSAGE_KEYS if k in data})
    if not out:
        raise BadRequestError("no messages")
    return out


def single_choice(params: Mapping[str, Any], interface: str) -> None:
    """Refuse ``n > 1`` where the interface's stream has room for one choice only."""
    if params.get("n", 1) not in (None, 1):
        raise BadRequestError(f"{interface}: n > 1 is not supported here (use the ChatModel flavour)")


def last_usage(chunks: list[Any]) -> Usage | None:
    """Token usage of the last chunk that carries it (ChatAgent / ChatModel streams)."""
    for chunk in reversed(chunks):
        usage = usage_dict(chunk.get("usage") if isinstance(chunk, dict) else getattr(chunk, "usage", None))
        if usage:
            return usage
    return None


class EngineBacked:
    """Engine client life cycle and trace policy shared by the flavours."""

    client: EngineClient | LogTimeClient | None = None
    tracing: TracePolicy = TracePolicy()

    def load_context(self, context: Any) -> None:
        self.client = EngineClient.from_model_config(context.model_config, context.artifacts)
        settings = self.client.settings
        self.tracing = TracePolicy(settings.tracing, settings.trace_sample_ratio)

    def _engine(self) -> EngineClient | LogTimeClient:
        if self.client is None:
            raise EngineUnavailableError(
                "the model has no engine: load it with mlflow.pyfunc.load_model (load_context was not called)"
            )
        return self.client

    @property
    def engine_process(self) -> Any:
        """The engine this model uses (:class:`launch.process.EngineProcess` of this process, or a
        :class:`launch.shared.SharedEngine`; the first replica's for a model with replicas, all of them are
        in ``client.engines``), or None (URL mode, log time)."""
        return getattr(self.client, "engine", None)

    def close(self) -> None:
        """Stop (or stop using) the engine this model holds, if any. Idempotent."""
        if self.client is not None:
            self.client.close()

    def batch(self, prompts: Any, **kwargs: Any) -> Any:
        """Many prompts at once, concurrently, results in input order: see :func:`model_code.batch.batch_predict`."""
        return batch_predict(self, prompts, **kwargs)
