"""What a server needs to serve a logged model: ``load_for_serving(model_uri)`` -> an object with
``predict(body)`` / ``predict_stream(body)`` taking the Databricks request shapes of its flavour.

Request shapes (the body of ``POST /invocations``):

- ChatAgent: ``{"messages": [...], "context": {...}, "custom_inputs": {...}, "stream": bool}``
- ChatModel: ``{"messages": [...], "temperature": ..., "max_tokens": ..., "custom_inputs": {...}, "stream": bool}``
- ResponsesAgent: ``{"input": [...], "temperature": ..., "max_output_tokens": ..., "custom_inputs": {...}, "stream": bool}``

MLflow's generic wrappers are unwrapped too: ``{"inputs": {...}}``, ``{"dataframe_records": [{...}]}``
(first record), ``{"dataframe_split": ...}``. ``stream`` is removed before the model sees the body:
call :meth:`ServedModel.predict_stream` when :func:`wants_stream` is true (what Databricks does).
Errors are :class:`model_code.errors.EngineRequestError` subclasses with ``status_code``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from model_code.loaded import python_model_of


def wants_stream(body: Mapping[str, Any]) -> bool:
    """Whether a request body asks for streaming (``"stream": true`` at the top level or inside ``inputs``)."""
    inner = body.get("inputs")
    return bool(body.get("stream")) or (isinstance(inner, Mapping) and bool(inner.get("stream")))


def normalize_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The flavour's own request mapping from a serving body (wrappers removed, ``stream`` dropped)."""
    from model_code.errors import BadRequestError

    if not isinstance(body, Mapping):
        raise BadRequestError(f"request body must be a JSON object, got {type(body).__name__}")
    data: Any = dict(body)
    if "inputs" in data and isinstance(data["inputs"], Mapping):
        data = {**data["inputs"], **(data.get("params") or {})}
    elif "dataframe_records" in data:
        records = data["dataframe_records"]
        if not records:
            raise BadRequestError("dataframe_records is empty")
        data = dict(records[0])
    elif "dataframe_split" in data:
        split = data["dataframe_split"]
        if not split.get("data"):
            raise BadRequestError("dataframe_split has no data")
        data = dict(zip(split["columns"], split["data"][0], strict=False))
    data.pop("stream", None)
    return data


class ServedModel:
    """A loaded model plus its flavour; ``predict`` / ``predict_stream`` take serving bodies."""

    def __init__(self, pyfunc_model: Any) -> None:
        from model_code.flavors.table import flavor_of  # loads every flavour: wants_stream and co. need none

        self.pyfunc_model = pyfunc_model
        self.python_model = python_model_of(pyfunc_model)
        self.flavor = flavor_of(self.python_model)
        self.metadata = pyfunc_model.metadata

    @property
    def task(self) -> str | None:
        return (self.metadata.metadata or {}).get("task")

    @property
    def gateway_section(self) -> dict[str, Any]:
        """The ``gateway:`` section of the logged ``model_config`` (server settings: keys, limits...), or {}."""
        section = (getattr(self.pyfunc_model, "model_config", None) or {}).get("gateway")
        return dict(section) if isinstance(section, Mapping) else {}

    @property
    def schedules_by_priority(self) -> bool:
        """Whether the model's engines run SGLang's priority scheduling (its engine section's, or its url entry's,
        ``enable_priority_scheduling``): a server in front of them may then send each request's priority class."""
        from model_code.target import resolve_target

        target = resolve_target(getattr(self.pyfunc_model, "model_config", None))
        if target.engine is not None:
            return target.engine.enable_priority_scheduling
        return target.deployment.models[target.name].enable_priority_scheduling

    @property
    def model_name(self) -> str | None:
        """The engine's served model name (the YAML key)."""
        client = getattr(self.python_model, "client", None)
        return getattr(client, "model", None)

    @property
    def upstreams(self) -> list[tuple[str, str | None]]:
        """(engine base URL without ``/v1``, API key or None) of each replica the model talks to, in order.

        Lets a server put the OpenAI endpoints in front of the same engines the model started (and balance
        over them as the model does); the served model name is :attr:`model_name`.
        """
        client = getattr(self.python_model, "client", None)
        upstreams = getattr(client, "upstreams", None)
        if not upstreams or not self.model_name:
            raise TypeError("this model has no engine client (was it loaded for logging?)")
        return [
            (base_url.removesuffix("/").removesuffix("/v1"), None if api_key in (None, "EMPTY") else api_key)
            for base_url, api_key in upstreams
        ]

    def predict(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.pyfunc_model.predict(normalize_request(body))

    def predict_stream(self, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        return self.pyfunc_model.predict_stream(normalize_request(body))

    def close(self) -> None:
        """Stop the engine the model started (if any)."""
        close = getattr(self.python_model, "close", None)
        if close is not None:
            close()


def load_for_serving(model_uri: str) -> ServedModel:
    """``mlflow.pyfunc.load_model(model_uri)`` (starts the engine, or connects to the config's URL) for serving."""
    import mlflow.pyfunc

    return ServedModel(mlflow.pyfunc.load_model(model_uri))
