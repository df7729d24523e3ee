"""Typed errors for engine calls, one per kind of failure, mapped from HTTP status (like TGI's ``errors.py``).

Every error is an :class:`mlflow.exceptions.MlflowException` whose ``error_code`` matches the kind, so
``mlflow models serve`` (and Databricks serving) answer with the right HTTP status instead of a bare 500.
``status_code`` is the HTTP status the gateway should use; ``engine_status`` what the engine answered.
"""

from __future__ import annotations

from typing import Any

import openai
from mlflow.exceptions import MlflowException
from mlflow.protos import databricks_pb2


class EngineRequestError(MlflowException):
    """An engine call failed. Base of every error below."""

    status_code = 500
    _error_code = databricks_pb2.INTERNAL_ERROR

    def __init__(self, message: str, *, engine_status: int | None = None, body: Any = None) -> None:
        super().__init__(message, error_code=self._error_code)
        self.engine_status = engine_status
        self.body = body


class BadRequestError(EngineRequestError):
    """The request was invalid (unknown parameter, bad JSON schema, bad messages): HTTP 400/422.

    ``param``: the field at fault when known (the request guard names it); ``code``: the kind of refusal."""

    status_code = 400
    _error_code = databricks_pb2.INVALID_PARAMETER_VALUE

    def __init__(
        self, message: str, *, engine_status: int | None = None, body: Any = None, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, engine_status=engine_status, body=body)
        self.param = param
        self.code = code


class ContextLengthError(BadRequestError):
    """The prompt plus ``max_tokens`` does not fit in the model's context."""


class AuthenticationError(EngineRequestError):
    """The engine or gateway refused the credentials: HTTP 401/403."""

    status_code = 401
    _error_code = databricks_pb2.UNAUTHENTICATED


class ModelNotFoundError(EngineRequestError):
    """The engine does not serve the requested model or path: HTTP 404."""

    status_code = 404
    _error_code = databricks_pb2.RESOURCE_DOES_NOT_EXIST


class OverloadedError(EngineRequestError):
    """The engine is busy or rate-limited: HTTP 429/503. Retry later."""

    status_code = 503
    _error_code = databricks_pb2.TEMPORARILY_UNAVAILABLE


class EngineInternalError(EngineRequestError):
    """The engine failed while generating: HTTP 5xx."""

    status_code = 500
    _error_code = databricks_pb2.INTERNAL_ERROR


class EngineUnavailableError(EngineRequestError):
    """No engine answered (not started, stopped, crashed, or unreachable)."""

    status_code = 503
    _error_code = databricks_pb2.TEMPORARILY_UNAVAILABLE


class EngineTimeoutError(EngineRequestError):
    """The engine did not answer within the request timeout."""

    status_code = 504
    _error_code = databricks_pb2.DEADLINE_EXCEEDED


_CONTEXT_HINTS = ("context length", "maximum context", "longer than the model", "too long", "exceeds the")


def error_for_status(status: int, message: str, body: Any = None) -> EngineRequestError:
    """The typed error for an engine HTTP ``status``."""
    text = f"engine answered HTTP {status}: {message}"
    if status in (400, 422):
        lowered = message.lower()
        cls: type[EngineRequestError] = (
            ContextLengthError if any(hint in lowered for hint in _CONTEXT_HINTS) else BadRequestError
        )
    elif status in (401, 403):
        cls = AuthenticationError
    elif status == 404:
        cls = ModelNotFoundError
    elif status in (429, 503):
        cls = OverloadedError
    elif status == 504:
        cls = EngineTimeoutError
    elif status >= 500:
        cls = EngineInternalError
    else:
        cls = BadRequestError if 400 <= status < 500 else EngineRequestError
    return cls(text, engine_status=status, body=body)


def from_openai_error(error: openai.OpenAIError) -> EngineRequestError:
    """Translate an ``openai`` client exception into the matching typed error."""
    if isinstance(error, openai.APITimeoutError):
        return EngineTimeoutError(f"engine did not answer in time: {error}")
    if isinstance(error, openai.APIConnectionError):
        return EngineUnavailableError(f"engine is unreachable: {error}")
    if isinstance(error, openai.APIStatusError):
        return error_for_status(error.status_code, _message(error), error.body)
    code = error.body.get("code") if isinstance(error, openai.APIError) and isinstance(error.body, dict) else None
    if isinstance(code, int) and 400 <= code < 600:  # an error event in a stream that had begun: its status is in it
        return error_for_status(code, _message(error), error.body)
    return EngineRequestError(f"engine call failed: {error}")


def _message(error: openai.APIError) -> str:
    body = error.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
    return error.message
