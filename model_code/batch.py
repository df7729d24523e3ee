"""Many prompts at once (scoring a table of reviews or documents in a notebook): a list or DataFrame of
prompts, an optional system prompt and JSON schema, sent concurrently to the engine, results in input order.

>>> model = mlflow.pyfunc.load_model(uri)
>>> batch_predict(model, ["What is Databricks?", "What is AI?"], json_schema=Grade, params={"temperature": 0.0})
[{"prompt": ..., "output": '{"grade": "yes"}', "parsed": {"grade": "yes"}, "finish_reason": "stop", "usage": {...}, "error": None}, ...]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import copy_context
from typing import Any

from mlflow.entities import SpanType

from model_code.client import EngineClient, LogTimeClient, usage_dict
from model_code.errors import BadRequestError, EngineRequestError
from model_code.loaded import python_model_of
from model_code.tracing import TracePolicy, traced_call

PROMPT_COLUMN = "prompt"


def _client_of(model: Any) -> EngineClient | LogTimeClient:
    """The engine client behind a loaded pyfunc model, a flavour instance, or a client itself."""
    if isinstance(model, (EngineClient, LogTimeClient)):
        return model
    model = python_model_of(model)
    client = getattr(model, "client", None)
    if client is None:
        raise TypeError(
            f"batch_predict needs a model loaded with mlflow.pyfunc.load_model, a model_code flavour or an EngineClient, got {type(model).__name__}"
        )
    return client


def _prompts(prompts: Any, column: str) -> list[str]:
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas comes with mlflow
        pd = None
    if pd is not None and isinstance(prompts, pd.DataFrame):
        if column not in prompts.columns:
            raise BadRequestError(
                f"the DataFrame has no {column!r} column (columns: {', '.join(map(str, prompts.columns))})"
            )
        return [str(p) for p in prompts[column].tolist()]
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise BadRequestError("prompts must be a list of strings, a list of {'prompt': ...} records, or a DataFrame")
    out = []
    for item in prompts:
        if isinstance(item, Mapping):
            if column not in item:
                raise BadRequestError(f"record {item!r} has no {column!r} key")
            out.append(str(item[column]))
        else:
            out.append(str(item))
    return out


def batch_predict(
    model: Any,
    prompts: Any,
    *,
    system_prompt: str | None = None,
    json_schema: Any = None,
    params: Mapping[str, Any] | None = None,
    max_workers: int | None = None,
    on_error: str = "raise",
    prompt_column: str = PROMPT_COLUMN,
) -> Any:
    """Send every prompt as its own chat request, ``max_workers`` at a time; results keep the input order.

    Args:
        model: a model from ``mlflow.pyfunc.load_model`` (any of the three flavours), a flavour
            instance, or an :class:`~model_code.client.EngineClient`.
        prompts: list of strings, list of ``{"prompt": ...}`` records, or a DataFrame with a ``prompt`` column.
        system_prompt: sent before every prompt.
        json_schema: a JSON schema (dict or JSON string) or a pydantic model class: constrained output,
            parsed into ``parsed``.
        params: generation parameters (same names as ``custom_inputs``: ``temperature``, ``max_tokens``...).
        max_workers: concurrent requests (default: ``mlflow.batch_concurrency`` of the config, 8).
        on_error: ``"raise"`` (the first failure raises its typed error) or ``"record"`` (its message
            goes in ``error`` and the batch goes on).

    Returns:
        A list of dicts ``{prompt, output, parsed, finish_reason, usage, error}``; for a DataFrame
        input, a copy of it with those columns added.

    The batch is one MLflow trace (inputs, outputs, summed usage), following the model's ``mlflow.tracing``.
    """
    if on_error not in ("raise", "record"):
        raise ValueError("on_error must be 'raise' or 'record'")
    client = _client_of(model)
    policy = TracePolicy(client.settings.tracing, client.settings.trace_sample_ratio)
    inputs = {"prompts": prompts, "system_prompt": system_prompt, "json_schema": json_schema, "params": params}
    return traced_call(
        policy,
        "batch_predict",
        SpanType.CHAIN,
        inputs,
        lambda: _run_batch(client, prompts, system_prompt, json_schema, params, max_workers, on_error, prompt_column),
        _summed_usage,
    )


def _run_batch(
    client: EngineClient | LogTimeClient,
    prompts: Any,
    system_prompt: str | None,
    json_schema: Any,
    params: Mapping[str, Any] | None,
    max_workers: int | None,
    on_error: str,
    prompt_column: str,
) -> Any:
    texts = _prompts(prompts, prompt_column)
    request = dict(params or {})
    if json_schema is not None:
        if hasattr(json_schema, "model_json_schema"):
            json_schema = json_schema.model_json_schema()
        request["json_schema"] = json_schema
    client.request(request)  # validate once, before sending anything
    workers = max_workers or client.settings.batch_concurrency

    def one(prompt: str) -> dict[str, Any]:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        result: dict[str, Any] = {
            "prompt": prompt,
            "output": None,
            "parsed": None,
            "finish_reason": None,
            "usage": None,
            "error": None,
        }
        try:
            response = client.chat(messages, request)
        except EngineRequestError as error:
            if on_error == "raise":
                raise
            result["error"] = str(error)
            return result
        choice = response.choices[0]
        result.update(
            output=choice.message.content, finish_reason=choice.finish_reason, usage=usage_dict(response.usage)
        )
        if json_schema is not None and choice.message.content is not None:
            try:
                result["parsed"] = json.loads(choice.message.content)
            except json.JSONDecodeError as error:
                result["error"] = f"output is not valid JSON ({error}); finish_reason={choice.finish_reason}"
        return result

    with ThreadPoolExecutor(
        max_workers=max(1, min(workers, len(texts) or 1)), thread_name_prefix="sglang-batch"
    ) as pool:
        # each prompt in a copy of this context: its request carries the batch's trace context (model_code.trace_context)
        contexts = [copy_context() for _ in texts]
        results = list(pool.map(lambda context, text: context.run(one, text), contexts, texts))
        # map keeps the input order and re-raises the first error

    try:
        import pandas as pd
    except ImportError:  # pragma: no cover
        return results
    if isinstance(prompts, pd.DataFrame):
        frame = prompts.copy()
        for key in ("output", "parsed", "finish_reason", "usage", "error"):
            frame[key] = [r[key] for r in results]
        return frame
    return results


def _summed_usage(results: Any) -> dict[str, int]:
    """Token usage of the whole batch (a list of result dicts, or the DataFrame with a ``usage`` column)."""
    usages = results["usage"].tolist() if hasattr(results, "columns") else [r["usage"] for r in results]
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for usage in usages:
        for key in totals:
            totals[key] += (usage or {}).get(key, 0)
    return totals
