"""A streamed answer through MLflow's AgentServer (``python -m model_code.agent_server``, ``POST /responses``) beside
the gateway's own ``POST /v1/responses``, in front of the same upstream, in the same run, alternating rounds.

Per side: the time to the first event and to the first text event (``response.output_text.delta``: what a user
sees first), the stream's whole time, and the server's CPU per streamed event and per text event (its whole
process group: AgentServer's command and workers; the gateway). One client, calls one after another. The agent
server runs twice: as users get it, MLflow tracing on (AgentServer's span and the flavour's, exported into a sqlite
store here: a Databricks App exports to its workspace instead), and with no trace sampled.

``--upstream stub``: the fake upstream (answers at once, exactly ``--output-tokens`` text pieces: what each server
adds); ``sglang-default``: the real CPU engine with the embedded default model (what a user waits for).

    .venv/bin/python -m benchmarks.agent_server_bench --upstream stub -n 40 --rounds 4 --output-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import processes
from launch.ports import pick_free_port

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
MODEL = "bench"
GATEWAY, AGENT, UNTRACED = "gateway /v1/responses", "AgentServer /responses", "AgentServer, traces off"


def experiment(out: Path) -> str:
    """An experiment of the run's sqlite store whose artifacts stay in ``out`` (experiment 0's would be ./mlruns)."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    found = client.get_experiment_by_name("agent-server-bench")
    if found is not None:
        return found.experiment_id
    return client.create_experiment("agent-server-bench", artifact_location=str(out / "mlflow-artifacts"))


@contextmanager
def agent_server(upstream: str, out: Path, workers: int, traced: bool = True) -> Iterator[tuple[str, processes.Child]]:
    """``python -m model_code.agent_server`` on a YAML whose model is ``upstream`` (URL mode: it starts no engine);
    ``traced``: MLflow's traces into a sqlite store, else none sampled (``MLFLOW_TRACE_SAMPLING_RATIO=0``)."""
    config = out / "agent.yaml"
    config.write_text(yaml.safe_dump({"models": {MODEL: {"url": upstream}}}))
    port = pick_free_port()
    argv = [sys.executable, "-m", "model_code.agent_server", str(config), "--host", "127.0.0.1", "--port", str(port)]
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}",
        "MLFLOW_EXPERIMENT_ID": experiment(out),
    }
    if not traced:
        env["MLFLOW_TRACE_SAMPLING_RATIO"] = "0"
    log = out / f"agent-server{'' if traced else '-untraced'}.log"
    child = processes.Child("agent server", [*argv, "--workers", str(workers)], log, env)
    try:
        url = f"http://127.0.0.1:{port}"
        processes.wait_http(url + "/health", child, 240)
        yield url, child
    finally:
        child.stop(grace_s=30)


def stream_once(http: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed call: seconds to the first event and to the first text event, whole seconds, events counted."""
    start = time.perf_counter()
    first = first_text = None
    events = texts = 0
    with http.stream("POST", url, json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter() - start
            events += 1
            first = now if first is None else first
            if '"response.output_text.delta"' in line:
                texts += 1
                first_text = now if first_text is None else first_text
    if first_text is None:
        raise RuntimeError(f"{url}: a stream without a text event")
    return {"first_event_s": first or 0.0, "first_text_s": first_text, "total_s": time.perf_counter() - start,
            "events": events, "texts": texts}  # fmt: skip


def run(upstream_kind: str, requests: int, rounds: int, tokens: int, workers: int, out: Path) -> dict[str, Any]:
    agent_body = {
        "input": [{"role": "user", "content": PROMPT}],
        "max_output_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    gateway_body = {"model": MODEL, **agent_body}
    with ExitStack() as stack:
        if upstream_kind == "stub":
            upstream, _ = stack.enter_context(processes.fake_upstream("starlette", out))
        else:
            upstream, _ = stack.enter_context(processes.sglang_engine(out, upstream_kind))
        gateway_url, gateway = stack.enter_context(processes.gateway(upstream, out))
        agent_url, agent = stack.enter_context(agent_server(upstream, out, workers))
        untraced_url, untraced = stack.enter_context(agent_server(upstream, out, workers, traced=False))
        sides = {
            GATEWAY: (gateway_url + "/v1/responses", gateway_body, gateway),
            AGENT: (agent_url + "/responses", agent_body, agent),
            UNTRACED: (untraced_url + "/responses", agent_body, untraced),
        }
        calls: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        cpu = dict.fromkeys(sides, 0.0)
        with httpx.Client(timeout=600) as http:
            for url, body, _ in sides.values():  # warm-up, untimed: connections, first-call imports
                stream_once(http, url, body)
            per_round = max(1, requests // rounds)
            for index in range(rounds):
                order = list(sides) if index % 2 == 0 else list(reversed(sides))  # ABC CBA
                for side in order:
                    url, body, child = sides[side]
                    before = processes.group_cpu_s(child.pid)
                    calls[side] += [stream_once(http, url, body) for _ in range(per_round)]
                    cpu[side] += processes.group_cpu_s(child.pid) - before
    rows = {}
    for side, results in calls.items():
        events, texts = sum(r["events"] for r in results), sum(r["texts"] for r in results)
        rows[side] = {
            "calls": len(results),
            "first_event_ms_p50": statistics.median(r["first_event_s"] for r in results) * 1000,
            "first_text_ms_p50": statistics.median(r["first_text_s"] for r in results) * 1000,
            "total_ms_p50": statistics.median(r["total_s"] for r in results) * 1000,
            "events_per_call": events / len(results),
            "texts_per_call": texts / len(results),
            "cpu_us_per_event": cpu[side] * 1e6 / max(events, 1),
            "cpu_us_per_text_event": cpu[side] * 1e6 / max(texts, 1),
        }
    keys = ("first_event_ms_p50", "first_text_ms_p50", "total_ms_p50", "cpu_us_per_text_event")
    ratios = {side: {key: rows[side][key] / rows[GATEWAY][key] for key in keys} for side in (AGENT, UNTRACED)}
    return {"upstream": upstream_kind, "workers": workers, "output_tokens": tokens, "rows": rows,
            "over_gateway": ratios, "load": os.getloadavg()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.agent_server_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--upstream", default="stub", choices=["stub", *processes.ENGINES])
    parser.add_argument("-n", "--requests", type=int, default=40, help="measured calls per side, split over the rounds")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help="AgentServer's uvicorn workers")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path("benchmarks/results") / f"{time.strftime('%Y%m%d-%H%M%S')}-agent-server-{args.upstream}"
    out.mkdir(parents=True, exist_ok=True)
    result = run(args.upstream, args.requests, args.rounds, args.output_tokens, args.workers, out)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(f"upstream {result['upstream']}, {args.output_tokens} tokens, AgentServer workers {args.workers}")
    for side, row in result["rows"].items():
        print(
            f"{side:26} first event {row['first_event_ms_p50']:8.1f} ms  first text {row['first_text_ms_p50']:8.1f} ms  "
            f"whole {row['total_ms_p50']:8.1f} ms  {row['events_per_call']:5.1f} events ({row['texts_per_call']:.1f} text)  "
            f"CPU {row['cpu_us_per_event']:7.1f} µs/event  {row['cpu_us_per_text_event']:7.1f} µs/text event"
        )
    for side, ratios in result["over_gateway"].items():
        print(f"{side} / gateway: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
