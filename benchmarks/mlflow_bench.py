"""MLflow wrapper cost: ``mlflow.pyfunc.load_model(uri).predict`` / ``predict_stream`` vs the raw ``openai``
client, against the same engine, in the same run, with alternating rounds.

Each flavour is logged in URL mode (``model_config = {"models": {"bench": {"url": ...}}}``: loading starts no
engine) into a throw-away sqlite tracking store under the results directory, then loaded once. Calls are
sequential (the wrapper's ``predict`` is synchronous): each figure is a per-call latency, and for streams
also the time to the first chunk; CPU ms per call (this thread, and the whole process) is the figure that
holds on a busy machine. The wrapper is measured as users get it (MLflow tracing on: one trace
per call), with ``mlflow.tracing.disable()``, and (when the model supports it) with ``tracing: sampled``.

Traces are exported by MLflow on a background thread of this process, so their export competes with the
calls that follow (that cost is part of "tracing on"); the queue is flushed, untimed, after each batch so
that it never spills into the next side's batch. ``trace_sink``: ``store`` (the sqlite tracking store, as
a notebook logs to its tracking server) or ``serving`` (MLflow's Model Serving mode: finished traces go
to an in-memory buffer for the serving layer, nothing is written). With ``MLFLOW_ENABLE_ASYNC_TRACE_LOGGING=false``
in the environment, ``store`` is a Databricks notebook's case: MLflow writes each trace on the thread that ends it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks.progress import progress_bar

MESSAGES = [{"role": "user", "content": " ".join(["hello"] * 24)}]
# What Databricks Model Serving sets in the container (traces then go to an in-memory buffer that the
# serving layer reads after each request; no MLFLOW_EXPERIMENT_ID: no copy to an experiment).
SERVING_ENV = {"IS_IN_DB_MODEL_SERVING_ENV": "true", "ENABLE_MLFLOW_TRACING": "true"}
SAMPLE_RATIO = 0.1
TARGET_ADDED_MS = 2.0  # predict / predict_stream within 2 ms of the raw client at p50
TARGET_TTFT_ADDED_MS = 1.0


def _inputs(flavor: str, max_tokens: int) -> dict[str, Any]:
    if flavor == "chat_agent":
        return {"messages": MESSAGES, "custom_inputs": {"max_tokens": max_tokens, "temperature": 0.0}}
    if flavor == "chat_model":
        return {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0.0}
    if flavor == "responses_agent":
        return {"input": MESSAGES, "max_output_tokens": max_tokens, "temperature": 0.0}
    raise ValueError(f"unknown flavour {flavor!r}")


def _ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


Call = Callable[[], float | None]
"""One timed call: returns the seconds to the first chunk (streams) or None."""


def run_mlflow_bench(
    url: str,
    flavors: list[str],
    requests: int,
    rounds: int,
    max_tokens: int,
    out_dir: Path,
    console: Console,
    trace_sink: str = "store",
) -> dict[str, Any]:
    if trace_sink not in ("store", "serving"):
        raise ValueError(f"trace_sink must be store or serving, got {trace_sink!r}")
    import mlflow
    import openai

    from model_code import close_model, log_model, python_model_of
    from model_code.tracing import flush_traces  # the wrapper's background recorder, then MLflow's queue

    mlflow.set_tracking_uri(f"sqlite:///{out_dir / 'mlflow.db'}")
    experiment = mlflow.create_experiment(
        f"bench-{time.time_ns()}", artifact_location=str(out_dir / "mlflow-artifacts")
    )
    mlflow.set_experiment(experiment_id=experiment)
    config = {"models": {"bench": {"url": url}}}
    raw = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="EMPTY", max_retries=0, timeout=600)

    def raw_predict() -> None:
        raw.chat.completions.create(model="bench", messages=MESSAGES, max_tokens=max_tokens, temperature=0.0)

    def raw_stream() -> float | None:
        start = time.perf_counter()
        first = None
        stream = raw.chat.completions.create(
            model="bench",
            messages=MESSAGES,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        with stream:
            for _ in stream:
                if first is None:
                    first = time.perf_counter() - start
        return first

    rows: list[dict[str, Any]] = []
    per_round = max(1, -(-requests // rounds))
    load_before = os.getloadavg()
    with progress_bar(console) as progress:
        task = progress.add_task("logging the models", total=None)
        infos = {}
        for flavor in flavors:
            with mlflow.start_run():
                infos[flavor] = log_model(config, flavor=flavor, flashinfer=None)
        progress.remove_task(task)
        if trace_sink == "serving":
            # After logging: MLflow 3.17.2's log_model deadlocks (nested trace_disabled) in this mode.
            os.environ.update(SERVING_ENV)
            os.environ.pop("MLFLOW_EXPERIMENT_ID", None)  # set by set_experiment: would also export to Databricks
            mlflow.tracing.reset()  # the next trace sets the tracer up again, now with the serving buffer
        for flavor in flavors:
            model = mlflow.pyfunc.load_model(infos[flavor].model_uri)
            flavour_instance = python_model_of(model)
            inputs = _inputs(flavor, max_tokens)

            def wrapped_predict(model: Any = model, inputs: dict[str, Any] = inputs) -> None:
                model.predict(inputs)

            def wrapped_stream(model: Any = model, inputs: dict[str, Any] = inputs) -> float | None:
                start = time.perf_counter()
                first = None
                for _ in model.predict_stream(inputs):
                    if first is None:
                        first = time.perf_counter() - start
                return first

            for mode, raw_call, wrapped_call in (
                ("predict", raw_predict, wrapped_predict),
                ("predict_stream", raw_stream, wrapped_stream),
            ):
                sides: dict[str, Call] = {"raw": raw_call, "tracing on": wrapped_call, "tracing off": wrapped_call}
                if hasattr(flavour_instance, "tracing"):
                    sides["tracing sampled"] = wrapped_call
                times: dict[str, list[float]] = {name: [] for name in sides}
                firsts: dict[str, list[float]] = {name: [] for name in sides}
                cpu: dict[str, list[float]] = {name: [0.0, 0.0] for name in sides}  # caller thread, whole process
                for name, call in sides.items():  # warm-up
                    _configure(mlflow, flavour_instance, name)
                    for _ in range(3):
                        call()
                flush_traces()  # the warm-up's traces: not written during the first measured batch
                task = progress.add_task(f"{flavor} {mode}", total=per_round * rounds * len(sides))
                for r in range(rounds):
                    order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                    for name in order:
                        _configure(mlflow, flavour_instance, name)
                        call = sides[name]
                        thread_cpu, process_cpu = time.thread_time(), time.process_time()
                        for _ in range(per_round):
                            start = time.perf_counter()
                            first = call()
                            times[name].append(time.perf_counter() - start)
                            if first is not None:
                                firsts[name].append(first)
                            progress.advance(task)
                        # untimed, but its CPU counts: no export spills into the next batch
                        flush_traces()
                        cpu[name][0] += time.thread_time() - thread_cpu
                        cpu[name][1] += time.process_time() - process_cpu
                _configure(mlflow, flavour_instance, "tracing on")
                progress.remove_task(task)
                calls = per_round * rounds
                rows += _rows(flavor, mode, times, firsts, {k: [v * 1000 / calls for v in c] for k, c in cpu.items()})
            close_model(model)
    flush_traces()
    raw.close()
    return {
        "rows": rows,
        "requests_per_side": per_round * rounds,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "trace_sink": trace_sink,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "target": f"predict and predict_stream within {TARGET_ADDED_MS:g} ms of the raw openai client at p50 "
        f"(tracing on), time to the first chunk within {TARGET_TTFT_ADDED_MS:g} ms",
    }


def _rows(
    flavor: str,
    mode: str,
    times: dict[str, list[float]],
    firsts: dict[str, list[float]],
    cpu_ms: dict[str, list[float]],
) -> list[dict[str, Any]]:
    """One row per wrapper side: latency and first-chunk figures against the raw side, and CPU ms per call
    (the caller's thread; the whole process, MLflow's export thread included): the figures that stay
    steady on a busy machine."""
    base, base_first = times["raw"], firsts["raw"]
    rows = []
    for name in times:
        if name == "raw":
            continue
        values = times[name]
        added = _ms(values, 50) - _ms(base, 50)  # type: ignore[operator]
        added_first = (
            _ms(firsts[name], 50) - _ms(base_first, 50) if firsts[name] and base_first else None  # type: ignore[operator]
        )
        met = added <= TARGET_ADDED_MS and (added_first is None or added_first <= TARGET_TTFT_ADDED_MS)
        rows.append(
            {
                "flavor": flavor,
                "mode": f"{mode} ({name})",
                "calls": len(values),
                "raw_p50_ms": _ms(base, 50),
                "raw_p90_ms": _ms(base, 90),
                "raw_p99_ms": _ms(base, 99),
                "wrapper_p50_ms": _ms(values, 50),
                "wrapper_p90_ms": _ms(values, 90),
                "wrapper_p99_ms": _ms(values, 99),
                "added_p50_ms": added,
                "added_p99_ms": _ms(values, 99) - _ms(base, 99),  # type: ignore[operator]
                "raw_ttft_p50_ms": _ms(base_first, 50),
                "wrapper_ttft_p50_ms": _ms(firsts[name], 50),
                "added_ttft_p50_ms": added_first,
                "ratio_p50": _ms(values, 50) / _ms(base, 50),  # type: ignore[operator]
                "raw_cpu_ms": cpu_ms["raw"][1],
                "added_caller_cpu_ms": cpu_ms[name][0] - cpu_ms["raw"][0],
                "added_process_cpu_ms": cpu_ms[name][1] - cpu_ms["raw"][1],
                "met": met if name == "tracing on" else None,
            }
        )
    return rows


def _configure(mlflow: Any, flavour_instance: Any, side: str) -> None:
    """MLflow tracing on/off for the side; the model's own policy for ``tracing sampled``."""
    if side == "tracing off":
        mlflow.tracing.disable()
    else:
        mlflow.tracing.enable()
    if hasattr(flavour_instance, "tracing"):
        from model_code.tracing import TracePolicy

        flavour_instance.tracing = TracePolicy("sampled", SAMPLE_RATIO) if side == "tracing sampled" else TracePolicy()
