"""MLflow wrapper cost: ``mlflow.pyfunc.load_model(uri).predict`` / ``predict_stream`` vs the raw ``openai``
client, against the same engine, in the same run, with alternating rounds.

Each flavour is logged in URL mode (``model_config = {"models": {"bench": {"url": ...}}}``: loading starts no
engine) into a throw-away sqlite tracking store under the results directory, then loaded once. Calls are
sequential (the wrapper's ``predict`` is synchronous): each figure is a per-call latency. The wrapper is
measured twice: as users get it (MLflow tracing on: one trace per call) and with ``mlflow.tracing.disable()``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks.progress import progress_bar

MESSAGES = [{"role": "user", "content": " ".join(["hello"] * 24)}]


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


def run_mlflow_bench(
    url: str, flavors: list[str], requests: int, rounds: int, max_tokens: int, out_dir: Path, console: Console
) -> dict[str, Any]:
    import mlflow
    import openai

    from model_code import close_model, log_model

    mlflow.set_tracking_uri(f"sqlite:///{out_dir / 'mlflow.db'}")
    experiment = mlflow.create_experiment(
        f"bench-{time.time_ns()}", artifact_location=str(out_dir / "mlflow-artifacts")
    )
    mlflow.set_experiment(experiment_id=experiment)
    config = {"models": {"bench": {"url": url}}}
    raw = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="EMPTY", max_retries=0, timeout=600)

    def raw_predict() -> None:
        raw.chat.completions.create(model="bench", messages=MESSAGES, max_tokens=max_tokens, temperature=0.0)

    def raw_stream() -> None:
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
                pass

    rows: list[dict[str, Any]] = []
    per_round = max(1, -(-requests // rounds))
    with progress_bar(console) as progress:
        for flavor in flavors:
            task = progress.add_task(f"logging {flavor}", total=None)
            with mlflow.start_run():
                info = log_model(config, flavor=flavor, flashinfer=None)
            model = mlflow.pyfunc.load_model(info.model_uri)
            inputs = _inputs(flavor, max_tokens)
            progress.remove_task(task)

            def wrapped_predict(model: Any = model, inputs: dict[str, Any] = inputs) -> None:
                model.predict(inputs)

            def wrapped_stream(model: Any = model, inputs: dict[str, Any] = inputs) -> None:
                for _ in model.predict_stream(inputs):
                    pass

            for mode, raw_call, wrapped_call in (
                ("predict", raw_predict, wrapped_predict),
                ("predict_stream", raw_stream, wrapped_stream),
            ):
                sides = {"raw": raw_call, "wrapper": wrapped_call, "wrapper (tracing off)": wrapped_call}
                times: dict[str, list[float]] = {name: [] for name in sides}
                for name, call in sides.items():  # warm-up
                    _set_tracing(mlflow, name)
                    for _ in range(3):
                        call()
                task = progress.add_task(f"{flavor} {mode}", total=per_round * rounds * len(sides))
                for r in range(rounds):
                    order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                    for name in order:
                        _set_tracing(mlflow, name)
                        call = sides[name]
                        for _ in range(per_round):
                            start = time.perf_counter()
                            call()
                            times[name].append(time.perf_counter() - start)
                            progress.advance(task)
                mlflow.tracing.enable()
                progress.remove_task(task)
                base = times["raw"]
                for name in ("wrapper", "wrapper (tracing off)"):
                    values = times[name]
                    added = _ms(values, 50) - _ms(base, 50)  # type: ignore[operator]
                    rows.append(
                        {
                            "flavor": flavor,
                            "mode": mode + (" (tracing off)" if "off" in name else ""),
                            "calls": len(values),
                            "raw_p50_ms": _ms(base, 50),
                            "raw_p90_ms": _ms(base, 90),
                            "raw_p99_ms": _ms(base, 99),
                            "wrapper_p50_ms": _ms(values, 50),
                            "wrapper_p90_ms": _ms(values, 90),
                            "wrapper_p99_ms": _ms(values, 99),
                            "added_p50_ms": added,
                            "ratio_p50": _ms(values, 50) / _ms(base, 50),  # type: ignore[operator]
                            "met": added <= 2.0 if mode == "predict" else None,
                        }
                    )
            close_model(model)
    mlflow.flush_trace_async_logging()
    raw.close()
    return {
        "rows": rows,
        "requests_per_side": per_round * rounds,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "target": "predict adds <= 2 ms (p50) over the raw openai client",
    }


def _set_tracing(mlflow: Any, side: str) -> None:
    if "off" in side:
        mlflow.tracing.disable()
    else:
        mlflow.tracing.enable()
