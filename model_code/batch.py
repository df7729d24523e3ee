"""Many prompts at once (scoring a table of reviews or documents in a notebook): a list or DataFrame of
prompts, an optional system prompt and JSON schema, sent concurrently to the engine, results in input order.
With ``via="batch"`` (a model in URL mode, at a gateway) the same requests go as one job to the gateway's batch
API (:mod:`model_code.batch_job`), which survives the kernel: ``submit_batch`` then ``batch_results``.

>>> model = mlflow.pyfunc.load_model(uri)
>>> batch_predict(model, ["What is Databricks?", "What is AI?"], json_schema=Grade, params={"temperature": 0.0})
[{"prompt": ..., "output": '{"grade": "yes"}', "parsed": {"grade": "yes"}, "finish_reason": "stop", "usage": {...}, "error": None}, ...]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import copy_context
from functools import partial
from typing import Any

import openai
from loguru import logger
from mlflow.entities import SpanType
from openai.types.chat import ChatCompletion

from model_code import batch_job
from model_code.client import EngineClient, LogTimeClient, usage_dict
from model_code.errors import BadRequestError, EngineRequestError, error_for_status
from model_code.loaded import python_model_of
from model_code.tracing import TracePolicy, traced_call

PROMPT_COLUMN = "prompt"
VIAS = ("direct", "batch")
RESULT_KEYS = ("output", "parsed", "finish_reason", "usage", "error")
PARSED_KEY = "json_schema"  # the batch's metadata says whether outputs are parsed, as the direct path does with json_schema


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
    via: str = "direct",
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
        via: ``"direct"`` (this process sends the requests) or ``"batch"`` (a model in URL mode at a gateway: the
            same requests as one job of the gateway's batch API, which survives the kernel; see :func:`submit_batch`;
            ``max_workers`` is then the gateway's ``batches.max_concurrency``).

    Returns:
        A list of dicts ``{prompt, output, parsed, finish_reason, usage, error}``; for a DataFrame
        input, a copy of it with those columns added.

    The batch is one MLflow trace (inputs, outputs, summed usage), following the model's ``mlflow.tracing``.
    """
    _check_choices(on_error, via)
    client = _client_of(model)
    policy = TracePolicy(client.settings.tracing, client.settings.trace_sample_ratio)
    inputs = {"prompts": prompts, "system_prompt": system_prompt, "json_schema": json_schema, "params": params}
    if via == "batch":
        _url_client(client)  # refused before anything is traced or sent
        run = partial(_via_batch, client, prompts, system_prompt, json_schema, params, on_error, prompt_column)
    else:
        run = partial(_run_batch, client, prompts, system_prompt, json_schema, params, max_workers, on_error, prompt_column)
    return traced_call(policy, "batch_predict", SpanType.CHAIN, inputs, run, _summed_usage)


def submit_batch(
    model: Any,
    prompts: Any,
    *,
    system_prompt: str | None = None,
    json_schema: Any = None,
    params: Mapping[str, Any] | None = None,
    prompt_column: str = PROMPT_COLUMN,
) -> str:
    """Hand the prompts to the gateway's batch API as one job and return its id at once (logged, so that it can
    be found after a kernel restart); :func:`batch_results` gets the results. Same arguments as :func:`batch_predict`.

    The lines are exactly the direct path's request bodies (the client's guard checks each one); ``custom_id`` is the
    row index. BadRequestError for a model not in URL mode, a gateway without the batch API, or a refused file.
    """
    client = _url_client(model)
    texts = _prompts(prompts, prompt_column)
    request = _request_of(json_schema, params)
    bodies = [client.chat_body(_messages(system_prompt, text), request) for text in texts]
    metadata = {"source": "model_code.batch_predict", "model": client.model, PARSED_KEY: "yes" if json_schema is not None else "no"}
    with _batch_api(client) as api:
        batch_id = batch_job.submit(api, bodies, metadata)
    logger.info(
        "model {}: batch {} submitted ({} prompts) to {}; batch_results(model, {!r}) gets its results, also after a kernel restart",
        client.model, batch_id, len(texts), client.base_url, batch_id,
    )
    return batch_id


def batch_results(
    model: Any,
    batch_id: str,
    prompts: Any = None,
    *,
    wait: bool = True,
    on_error: str = "raise",
    prompt_column: str = PROMPT_COLUMN,
) -> Any:
    """The results of a batch :func:`submit_batch` made, in :func:`batch_predict`'s shape, once it ended.

    ``prompts``: those it was submitted with (a DataFrame gets the result columns added); None: read back from the
    batch's input file, for a list. ``wait``: poll until the batch ends; else None while it runs. ``on_error``: as
    :func:`batch_predict`'s (lines never sent, of a cancelled or expired batch, are failures too).
    """
    _check_choices(on_error, "batch")
    with _batch_api(_url_client(model)) as api:
        batch = batch_job.wait_ended(api, batch_id) if wait else batch_job.retrieve(api, batch_id)
        if batch.status not in batch_job.ENDED:
            return None
        bodies = batch_job.input_bodies(api, batch)
        lines = batch_job.result_lines(api, batch)
    texts = _prompts(prompts, prompt_column) if prompts is not None else [_last_user_text(body) for body in bodies]
    if len(texts) != len(bodies):
        raise BadRequestError(f"batch {batch_id} has {len(bodies)} lines, but {len(texts)} prompts were given")
    wants_json = (batch.metadata or {}).get(PARSED_KEY) == "yes"
    results = [_line_result(text, lines.get(str(index)), wants_json, on_error, batch) for index, text in enumerate(texts)]
    return _shaped(prompts, results)


def _via_batch(
    client: EngineClient, prompts: Any, system_prompt: str | None, json_schema: Any, params: Mapping[str, Any] | None,
    on_error: str, prompt_column: str,
) -> Any:
    """``via="batch"``: :func:`submit_batch` then :func:`batch_results`, waiting for the batch to end."""
    batch_id = submit_batch(client, prompts, system_prompt=system_prompt, json_schema=json_schema, params=params, prompt_column=prompt_column)
    return batch_results(client, batch_id, prompts, on_error=on_error, prompt_column=prompt_column)


def _check_choices(on_error: str, via: str) -> None:
    if on_error not in ("raise", "record"):
        raise ValueError("on_error must be 'raise' or 'record'")
    if via not in VIAS:
        raise ValueError(f"via must be one of {', '.join(map(repr, VIAS))}, got {via!r}")


def _url_client(model: Any) -> EngineClient:
    """The client of a model in URL mode: the gateway it points at holds batch jobs; a managed engine has no gateway."""
    client = _client_of(model)
    if not isinstance(client, EngineClient) or client.engines:
        raise BadRequestError(
            f"via='batch' needs a model in URL mode (a gateway's url in model_config); model {client.model!r} is not "
            "(it runs its own engine, which has no batch API, or MLflow is logging it): use via='direct'",
            code="not_url_mode",
        )
    return client


def _batch_api(client: EngineClient) -> openai.OpenAI:
    """An ``openai`` client at the model's URL with its key, for the files and batches routes (closed after use)."""
    return openai.OpenAI(
        base_url=client.base_url, api_key=client.api_key, timeout=client.settings.request_timeout_s, max_retries=client.settings.max_retries
    )


def _request_of(json_schema: Any, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The generation parameters of every prompt: ``params`` with ``json_schema`` (a pydantic class: its schema)."""
    request = dict(params or {})
    if json_schema is not None:
        if hasattr(json_schema, "model_json_schema"):
            json_schema = json_schema.model_json_schema()
        request["json_schema"] = json_schema
    return request


def _messages(system_prompt: str | None, prompt: str) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": prompt}]


def _empty_result(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "output": None, "parsed": None, "finish_reason": None, "usage": None, "error": None}


def _answered(prompt: str, response: ChatCompletion, wants_json: bool) -> dict[str, Any]:
    """The result of an answered prompt (the same for both paths); output that is not the asked JSON is its error."""
    result = _empty_result(prompt)
    choice = response.choices[0]
    result.update(output=choice.message.content, finish_reason=choice.finish_reason, usage=usage_dict(response.usage))
    if wants_json and choice.message.content is not None:
        try:
            result["parsed"] = json.loads(choice.message.content)
        except json.JSONDecodeError as error:
            result["error"] = f"output is not valid JSON ({error}); finish_reason={choice.finish_reason}"
    return result


def _failed(prompt: str, error: EngineRequestError, on_error: str) -> dict[str, Any]:
    if on_error == "raise":
        raise error
    return {**_empty_result(prompt), "error": str(error)}


def _line_result(prompt: str, line: dict[str, Any] | None, wants_json: bool, on_error: str, batch: Any) -> dict[str, Any]:
    """A result line of the batch as the direct path's result: an answer, or the typed error of its status."""
    response = (line or {}).get("response") or {}
    if line is not None and response.get("status_code") == 200:
        return _answered(prompt, ChatCompletion.model_validate(response["body"]), wants_json)
    return _failed(prompt, _line_error(line, response, batch), on_error)


def _line_error(line: dict[str, Any] | None, response: dict[str, Any], batch: Any) -> EngineRequestError:
    """What the direct path would raise for that answer (``error_for_status``); a line never sent, its reason."""
    if line is None:
        return EngineRequestError(f"batch {batch.id} ended {batch.status} without a result for this line")
    error = line.get("error") or {}
    status, body = response.get("status_code"), response.get("body")
    inner = body.get("error", body) if isinstance(body, dict) else None
    message = str((inner or {}).get("message") or error.get("message") or body)
    if status is None:
        return EngineRequestError(f"batch line not sent ({error.get('code')}): {message}", body=error)
    return error_for_status(int(status), message, body)


def _last_user_text(body: Mapping[str, Any]) -> str:
    """A line's prompt: its last user message."""
    users = [message for message in body.get("messages") or () if message.get("role") == "user"]
    return str(users[-1].get("content")) if users else ""


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
    request = _request_of(json_schema, params)
    client.request(request)  # validate once, before sending anything
    workers = max_workers or client.settings.batch_concurrency

    def one(prompt: str) -> dict[str, Any]:
        try:
            response = client.chat(_messages(system_prompt, prompt), request)
        except EngineRequestError as error:
            return _failed(prompt, error, on_error)
        return _answered(prompt, response, json_schema is not None)

    with ThreadPoolExecutor(
        max_workers=max(1, min(workers, len(texts) or 1)), thread_name_prefix="sglang-batch"
    ) as pool:
        # each prompt in a copy of this context: its request carries the batch's trace context (model_code.trace_context)
        contexts = [copy_context() for _ in texts]
        results = list(pool.map(lambda context, text: context.run(one, text), contexts, texts))
        # map keeps the input order and re-raises the first error
    return _shaped(prompts, results)


def _shaped(prompts: Any, results: list[dict[str, Any]]) -> Any:
    """``results`` as the caller gave the prompts: a copy of a DataFrame with the result columns, else the list."""
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover
        return results
    if isinstance(prompts, pd.DataFrame):
        frame = prompts.copy()
        for key in RESULT_KEYS:
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
