"""The bench CLI runs end to end on a tiny workload against the fake upstream and writes JSON, for every API
it speaks (chat completions, Responses, Messages); its load generator reads the real engine's streams the
way it reads the fake's, and the fake sends the engine's event sequence.

No timing is asserted (speed is measured by the benchmarks themselves, never by tests): only that runs
complete, count their requests and tokens, see no errors and leave well-formed results behind.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from benchmarks import fake_upstream, processes
from benchmarks.apis import APIS
from benchmarks.loadgen import StreamParser, Workload, new_event_loop, run_batch
from benchmarks.postgres import postgres_missing
from launch.process import EngineProcess

REPO = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("kind", ["raw", "starlette"])
def test_load_generator_against_fake_upstream(tmp_path: Path, kind: str) -> None:
    with processes.fake_upstream(kind, tmp_path) as (url, _):
        loop = new_event_loop()
        try:
            for api in APIS:
                for stream in (True, False):
                    workload = Workload(api=api, stream=stream, output_tokens=5)
                    batch = loop.run_until_complete(run_batch(url, workload, 3, 9))
                    assert len(batch.samples) == 9 and all(s.ok for s in batch.samples), (api, batch.samples)
                    assert all(s.tokens == 5 for s in batch.samples), (api, stream)
                    if stream:
                        assert all(s.ttft is not None and s.ttft <= s.latency for s in batch.samples), api
        finally:
            loop.close()


@pytest.mark.parametrize("api", list(APIS))
def test_a_stream_cut_short_or_ending_in_an_error_counts_as_failed(api: str) -> None:
    """The load generator tells a complete stream from a broken one, in each dialect (the fake's frames)."""
    events = list(fake_upstream.ANSWERS[APIS[api].path](orjson.dumps(APIS[api].body("m", "hi", 3, True))).events or ())
    error = {
        "chat": b'data: {"error": {"message": "engine died", "code": 503}}\n\n',
        "responses": b'event: error\ndata: {"type": "error", "message": "engine died"}\n\n',
        "messages": b'event: error\ndata: {"type": "error", "error": {"message": "engine died"}}\n\n',
    }[api]
    for stream, problem in (
        (events, None),
        (events[:-1], "stream ended without its last event"),
        (events[:-2] + [error], "engine died"),
    ):
        parser = StreamParser(APIS[api], stream=True)
        for event in stream:
            parser.feed_stream(event, 0.0)
        found = parser.stream_problem()
        assert (found is None) if problem is None else (problem in (found or "")), (api, found)
        assert parser.events == 3


def test_compare_cli_end_to_end_for_every_api(tmp_path: Path) -> None:
    out = tmp_path / "result"
    proc = _bench(
        "compare", "--upstream", "stub", "-c", "1,2", "-n", "6", "--rounds", "2", "--warmup", "2",
        "--output-tokens", "4", "--max-seconds", "30", "--api", "chat,responses,messages", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["kind"] == "compare" and result["upstream"] == "stub-starlette"
    assert list(result["apis"]) == ["chat", "responses", "messages"]
    for api, measured in result["apis"].items():
        assert measured["workload"]["path"] == APIS[api].path
        assert set(measured["levels"]) == {"1", "2"}
        for entry in measured["levels"].values():
            for target in ("direct", "gateway"):
                assert entry[target]["requests"] == 6 and entry[target]["errors"] == 0, (api, entry[target])
                assert entry[target]["mean_out_tokens"] == 4
                assert entry[target]["ttft_p50_ms"] is not None
            assert entry["vs"]["req_s"]["ratio"] > 0
            assert "gateway" in entry["gateway"]["cpu_ms_per_req"]
        assert {check["target"] for check in measured["targets"]} >= {"stub c=1: added p50 latency"}
    assert {(row["api"], row["c"]) for row in result["summary"]} == {(a, c) for a in APIS for c in (1, 2)}
    assert "gw/direct" in proc.stdout and "gateway/direct per API" in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert all((out / f"plot-{api}.png").stat().st_size > 0 for api in APIS)


def _compare_on_stub(out: Path, option: str, levels: str, *more: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``compare`` against the stub with ``option`` (a third target next to the plain gateway; ``more``: further
    options): 6 requests a level in 2 rounds, 2 warm-ups; its output and its result.json."""
    proc = _bench(
        "compare", "--upstream", "stub", option, *more, "-c", levels, "-n", "6", "--rounds", "2", "--warmup", "2",
        "--output-tokens", "4", "--max-seconds", "30", "--no-plot", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads((out / "result.json").read_text())


def test_compare_with_tenants_runs_a_keyed_gateway_with_the_ledger_next_to_the_plain_one(tmp_path: Path) -> None:
    out = tmp_path / "result"
    proc, result = _compare_on_stub(out, "--tenants", "1,2")
    assert result["targets_measured"] == ["direct", "gateway", "gateway-keys", "gateway-twin"]
    for entry in result["apis"]["chat"]["levels"].values():
        assert entry["gateway-keys"]["requests"] == 6 and entry["gateway-keys"]["errors"] == 0, entry["gateway-keys"]
        assert entry["vs_gateway"]["gateway-keys"]["req_s"]["ratio"] > 0 and "gateway" in entry["gateway-keys"]["cpu_ms_per_req"]
    checks = {check["target"] for check in result["apis"]["chat"]["targets"]}
    assert {"keys+ledger c=1: added p50 latency", "stub c=1: added p50 latency", "noise: twin c=1: added p50 latency"} <= checks
    assert entry["vs_gateway"]["gateway-twin"]["req_s"]["ratio"] > 0  # the A/A control: a second plain gateway
    assert [(row["api"], row["c"]) for row in result["tenants"]["summary"]] == [("chat", 1), ("chat", 2)]
    # every request of the load (warm-ups too) was the named key's, and has its ledger row
    assert result["tenants"]["ledger_rows"]["bench:200"] == 2 * (2 + 6), result["tenants"]
    assert (out / "gateway-state").is_dir() and not (out / "gateway-state" / "usage.sqlite3").exists()  # the plain one: no ledger
    assert "gateway-keys/gw" in proc.stdout and "keys + ledger / plain gateway per API" in proc.stdout


def test_compare_with_shared_runs_the_keyed_gateway_as_a_replica_sharing_a_postgres_store(tmp_path: Path) -> None:
    """``--tenants --shared``: the keyed gateway once more as a replica sharing a store (a PostgreSQL server the run
    starts and removes), measured against the keyed gateway alone; its ledger rows and the Responses it created are in
    the store. Without --tenants it is refused before anything starts."""
    why = postgres_missing()
    if why is not None:
        pytest.skip(f"PostgreSQL tests skipped: {why}")
    out = tmp_path / "result"
    proc, result = _compare_on_stub(out, "--tenants", "1", "--shared", "--api", "chat,responses")
    assert result["targets_measured"] == ["direct", "gateway", "gateway-keys", "gateway-shared", "gateway-twin"]
    for api in ("chat", "responses"):
        entry = result["apis"][api]["levels"]["1"]
        assert entry["gateway-shared"]["requests"] == 6 and entry["gateway-shared"]["errors"] == 0, entry["gateway-shared"]
        assert entry["vs_reference"]["gateway-shared"]["latency_p50_ms"]["added_ms"] is not None
        assert set(entry["gateway-shared"]["cpu_ms_per_req"]) >= {"gateway", "postgres", "upstream"}  # the store's CPU too
        checks = {check["target"] for check in result["apis"][api]["targets"]}
        assert f"shared store c=1: added p50 latency ({api})" in checks, checks
    assert [(row["api"], row["c"]) for row in result["shared"]["summary"]] == [("chat", 1), ("responses", 1)]
    # every request of the load (warm-ups too) was the named key's and is in the store's ledger; every Responses
    # stream's id was published to the store
    assert result["shared"]["ledger_rows"]["bench:200"] == 2 * (2 + 6), result["shared"]
    assert result["shared"]["responses_published"] == 2 + 6, result["shared"]
    config = yaml.safe_load((out / "gateway-shared" / "gateway.yaml").read_text())["gateway"]
    assert config["replicas"]["shared"] is True and config["usage"]["database_url"].startswith("postgresql+psycopg://")
    assert all(yaml.safe_load(path.read_text())["gateway"]["workers"] == 1 for path in out.rglob("gateway.yaml"))
    assert "shared replica / keys + ledger alone per API" in proc.stdout
    refused = _bench("compare", "--upstream", "stub", "--shared", "-n", "2", "--no-plot", "--out", str(tmp_path / "r2"))
    said = " ".join(refused.stderr.replace("│", " ").split())
    assert refused.returncode == 2 and "add --tenants" in said and "Traceback" not in said, said
    assert "starting" not in refused.stdout  # refused before anything started


def test_compare_with_tracing_runs_a_traced_gateway_whose_spans_all_reach_the_sink(tmp_path: Path) -> None:
    proc, result = _compare_on_stub(tmp_path / "result", "--tracing", "1")
    assert result["targets_measured"] == ["direct", "gateway", "gateway-traced"]
    entry = result["apis"]["chat"]["levels"]["1"]
    assert entry["gateway-traced"]["requests"] == 6 and entry["gateway-traced"]["errors"] == 0, entry["gateway-traced"]
    assert "tracing c=1: added p50 latency" in {check["target"] for check in result["apis"]["chat"]["targets"]}
    # every request of the load (warm-ups too) was exported: its server span, queue wait and upstream attempt;
    # the benchmark's readiness probes (GET /ready) are not traced
    spans = result["tracing"]["spans_exported"]
    assert spans == {"POST /v1/chat/completions": 2 + 6, "gateway.queue": 8, "chat bench": 8}, spans
    assert "traced / plain gateway per API" in proc.stdout


def _marking_checkout(tmp_path: Path) -> tuple[Path, Path]:
    """A "checkout" for --baseline: this one's packages, and a ``sitecustomize`` that creates the returned mark
    when a process imports from it (only the baseline's gateway has it on its path)."""
    checkout = tmp_path / "before"
    checkout.mkdir()
    for package in ("gateway", "launch", "model_code"):
        (checkout / package).symlink_to(REPO / package)
    mark = tmp_path / "imported-from-baseline"
    (checkout / "sitecustomize.py").write_text(f"open({str(mark)!r}, 'a').write('x')\n")
    return checkout, mark


def test_compare_with_a_baseline_runs_that_checkouts_code_next_to_the_plain_gateway(tmp_path: Path) -> None:
    """``--baseline DIR``: a third gateway whose PYTHONPATH is DIR (here: this checkout's packages, and a
    ``sitecustomize`` that leaves a mark, so the test sees the baseline's process import from DIR)."""
    checkout, mark = _marking_checkout(tmp_path)
    proc, result = _compare_on_stub(tmp_path / "result", f"--baseline={checkout}", "1")
    assert result["targets_measured"] == ["direct", "gateway", "gateway-baseline"]
    entry = result["apis"]["chat"]["levels"]["1"]
    assert entry["gateway-baseline"]["requests"] == 6 and entry["gateway-baseline"]["errors"] == 0, entry["gateway-baseline"]
    assert entry["vs_gateway"]["gateway-baseline"]["req_s"]["ratio"] > 0 and "gateway" in entry["gateway-baseline"]["cpu_ms_per_req"]
    assert [(row["api"], row["c"]) for row in result["baseline"]["summary"]] == [("chat", 1)]
    assert mark.exists()  # only the baseline's process has DIR on its path
    assert "gateway-baseline" in proc.stdout and "/ this gateway per API" in proc.stdout
    refused = _bench("compare", "--upstream", "stub", f"--baseline={tmp_path}", "-n", "2", "--no-plot", "--out", str(tmp_path / "r2"))
    said = " ".join(refused.stderr.replace("│", " ").split())  # typer's box wraps long lines
    assert refused.returncode == 2 and "not a checkout of this project" in said and "Traceback" not in said, said
    assert "starting" not in refused.stdout  # refused before anything started


def test_compare_with_the_router_as_a_target_measures_it_beside_the_gateway(tmp_path: Path) -> None:
    """``--router-target``: SGLang's router in front of the same stub, a target of its own (its CPU its own), and a
    table of what it keeps of direct next to what the gateway keeps; with ``--router`` (in front) it is refused."""
    proc, result = _compare_on_stub(tmp_path / "result", "--router-target", "1")
    assert result["targets_measured"] == ["direct", "gateway", "router"]
    entry = result["apis"]["chat"]["levels"]["1"]
    assert entry["router"]["requests"] == 6 and entry["router"]["errors"] == 0, entry["router"]
    assert entry["router"]["mean_out_tokens"] == 4  # the stub's tokens came through the router
    assert set(entry["router"]["cpu_ms_per_req"]) >= {"router", "upstream"} and "gateway" not in entry["router"]["cpu_ms_per_req"]
    [row] = result["router_target"]["summary"]
    assert (row["api"], row["c"]) == ("chat", 1) and row["req_s_ratio"] == entry["vs_direct"]["router"]["req_s"]["ratio"] > 0
    assert row["gateway_req_s_ratio"] == entry["vs"]["req_s"]["ratio"] and row["router_cpu_ms_per_req"] is not None  # (6 requests: it may round to 0 ticks)
    assert "SGLang's router / direct per API" in proc.stdout
    refused = _bench("compare", "--upstream", "stub", "--router", "--router-target", "-n", "2", "--no-plot", "--out", str(tmp_path / "r2"))
    said = " ".join(refused.stderr.replace("│", " ").split())
    assert refused.returncode == 2 and "pick one" in said and "Traceback" not in said, said
    assert "starting" not in refused.stdout  # refused before anything started


# Enough events (~3,000) for tens of ms of each gateway's CPU: /proc counts CPU in 10 ms ticks, and 8 streams of 5
# tokens (~60 events, a few ms) once read as 0.0 in CI.
PACED_STREAMS, PACED_TOKENS = 32, 90


def test_paced_with_a_baseline_relays_through_both_gateways_and_splits_their_cpu(tmp_path: Path) -> None:
    """``paced --baseline DIR``: every stream through the gateway and through the same gateway run from DIR (its
    ``sitecustomize`` leaves a mark), each row with its CPU per event and the kernel's part of it."""
    checkout, mark = _marking_checkout(tmp_path)
    out = tmp_path / "paced"
    proc = _bench(
        "paced", "-s", str(PACED_STREAMS), "--tokens", str(PACED_TOKENS), "--step-ms", "10", "--ramp-s", "0.1",
        "--targets", "direct,gateway", f"--baseline={checkout}", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((out / "result.json").read_text())["rows"]
    assert [row["target"] for row in rows] == ["direct", "gateway", "gateway-baseline"]
    for row in rows:  # the same events through each (the tokens and the stream's own first and last events)
        assert row["errors"] == 0 and row["completed"] == PACED_STREAMS, row
        assert row["events"] == rows[0]["events"] > PACED_STREAMS * PACED_TOKENS, row
    for row in rows[1:]:
        assert row["cpu_us_per_event_proxy"] > 0 and 0 <= row["cpu_us_per_event_proxy_system"] <= row["cpu_us_per_event_proxy"]
        for q in ("p50", "p99"):  # the gap each proxy adds: its own minus direct's, same run
            assert row[f"gap_added_{q}_ms"] == row[f"gap_{q}_ms"] - rows[0][f"gap_{q}_ms"], row
    assert rows[0]["gap_added_p50_ms"] is None
    assert mark.exists()  # only the baseline's process has DIR on its path
    assert "gateway-baseline/gateway CPU per event" in " ".join((proc.stdout + proc.stderr).split())  # (rich wraps lines)


def test_run_cli_plain_answers_and_a_bad_api_name(tmp_path: Path) -> None:
    with processes.fake_upstream("raw", tmp_path) as (url, _):
        out = tmp_path / "run"
        proc = _bench(
            "run", url, "-c", "2", "-n", "4", "--warmup", "0", "--no-stream", "--output-tokens", "3",
            "--api", "responses,messages", "--no-plot", "--out", str(out),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result = json.loads((out / "result.json").read_text())
        for api in ("responses", "messages"):
            level = result["apis"][api]["levels"]["2"]["target"]
            assert level["ok"] == 4 and level["mean_out_tokens"] == 3 and level["ttft_p50_ms"] is None
        refused = _bench("run", url, "--api", "chat,completions")
    assert refused.returncode == 2
    assert "unknown API completions" in refused.stderr and "Traceback" not in refused.stderr


# ------------------------------------------------------------------ the real engine's frames
def _event_types(text: str) -> list[str]:
    """The SSE event names of a stream, runs of one name collapsed (the count of text deltas varies)."""
    names = re.findall(r"^event: (\S+)$", text, flags=re.M)
    return [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]


@pytest.mark.engine
def test_load_generator_reads_the_real_engines_streams(tiny_engine: EngineProcess) -> None:
    loop = new_event_loop()
    try:
        for api in APIS:
            for stream in (True, False):
                workload = Workload(model="tiny", api=api, stream=stream, output_tokens=6)
                batch = loop.run_until_complete(run_batch(tiny_engine.url, workload, 2, 2))
                assert all(s.ok for s in batch.samples), (api, stream, batch.samples)
                assert all(0 < s.tokens <= 6 for s in batch.samples), (api, stream, batch.samples)
                assert all((s.ttft is not None) == stream for s in batch.samples), (api, stream)
    finally:
        loop.close()


@pytest.mark.engine
def test_the_fake_upstream_sends_the_engines_event_sequence(tiny_engine: EngineProcess, tmp_path: Path) -> None:
    """Responses and Messages streams of the fake have the event names, in order, of SGLang's own."""
    with processes.fake_upstream("raw", tmp_path) as (fake, _), httpx.Client(timeout=120) as http:
        for api in ("responses", "messages"):
            body = orjson.loads(Workload(model="tiny", api=api, output_tokens=6).body())
            real = http.post(tiny_engine.url + APIS[api].path, json=body).text
            faked = http.post(fake + APIS[api].path, json=body).text
            assert _event_types(faked) == _event_types(real), (api, real[:2000])


def test_the_agent_workload_is_a_chat_request_the_gateways_guard_takes() -> None:
    """The costs benchmark's agent requests (``--agent``) are what an agent loop sends, valid for the gateway: their
    CPU is the guard's whole work, not a refusal's."""
    from engine_guard.schemas import parse_body
    from gateway.core.endpoints import PROXIED_BY_PATH

    for stream in (True, False):
        raw = Workload(agent=True, stream=stream).body()
        body = parse_body(raw, PROXIED_BY_PATH["/v1/chat/completions"].schema, "/v1/chat/completions")
        assert len(body["tools"]) == 8 and len(body["messages"]) == 17
        assert [m["role"] for m in body["messages"][:4]] == ["system", "user", "assistant", "tool"]
    with pytest.raises(ValueError, match="chat"):
        Workload(agent=True, api="messages").body()
