"""The usage ledger: a row for every request (errors, cut streams and disconnects included), read back by
``GET /admin/usage`` and ``sglang-gateway usage``; written on SIGTERM; nothing lost while PostgreSQL is down;
a full buffer drops its oldest rows, counted.

Against a FAKE upstream (:func:`usage_upstream`, a small Starlette app named as one): an engine cannot be made
to report chosen cached-token counts, fail with a 500 or cut a stream on demand, and engine starts are costly
here. SQLite always; PostgreSQL against a real server of the session's own (``postgres`` in tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
import yaml
from loguru import logger
from prometheus_client import CollectorRegistry, Counter
from sqlalchemy import create_engine, select

from gateway.config import UsageSettings, gateway_settings
from gateway.core.context import RequestInfo
from gateway.tenants import ledger as ledger_module
from gateway.tenants.ledger import Ledger, UsageRow
from gateway.tenants.ledger_schema import LATEST, SchemaError, migrate, open_engine, schema_version, usage_rows
from gateway.tenants.usage_query import UsageReader, parse_query
from launch.config import ConfigError, parse_config
from launch.ports import pick_free_port
from tests.admin_client import prometheus_value
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import KEY, auth, serve
from tests.postgres import PostgresServer
from tests.servers import CLI, ServerProcess
from tests.waiting import wait_until

ADMIN = "ledger-admin-key"
USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18, "prompt_tokens_details": {"cached_tokens": 4}}
FAST = {"flush_interval_s": 0.05}


# ------------------------------------------------------------------------------ the FAKE upstream
def _upstream_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def chunk(delta: dict[str, Any], usage: Any = None, choices: bool = True) -> bytes:
        body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "usage": usage,
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}] if choices else []}  # fmt: skip
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    async def chat(request: Request) -> Response:
        body = await request.json()
        text = body["messages"][-1]["content"]
        if text == "FAIL":
            return JSONResponse({"error": {"message": "FAKE upstream failure", "type": "server_error", "code": 500}}, 500)
        if not body.get("stream"):
            message = {"role": "assistant", "content": "tok " * 7}
            return JSONResponse({"id": "c1", "object": "chat.completion", "created": 1, "model": "m", "usage": USAGE,
                                 "choices": [{"index": 0, "message": message, "finish_reason": "length"}]})  # fmt: skip

        async def events() -> Any:
            yield chunk({"role": "assistant", "content": ""})
            for _ in range(100 if text == "SLOW" else 7):
                await asyncio.sleep(0.05 if text == "SLOW" else 0)
                yield chunk({"content": "tok "})
            if text == "CUT":
                raise RuntimeError("FAKE upstream cut mid-stream")  # uvicorn drops the connection: no end of body
            yield chunk({}, usage=USAGE, choices=False)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def messages(request: Request) -> Response:
        if (await request.json()).get("stream"):  # as SGLang says a short answer's prompt: input_tokens 0
            events = [
                ("message_start", {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                                   "content": [], "usage": {"input_tokens": 0, "output_tokens": 0}}}),
                ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "tok"}}),
                ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}}),
                ("message_stop", {"type": "message_stop"}),
            ]  # fmt: skip
            sse = b"".join(b"event: %s\ndata: %s\n\n" % (name.encode(), json.dumps(data).encode()) for name, data in events)
            return Response(sse, media_type="text/event-stream")
        usage = {"input_tokens": 13, "output_tokens": 6, "cache_read_input_tokens": 2}
        return JSONResponse({"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "max_tokens",
                             "content": [{"type": "text", "text": "tok"}], "usage": usage})  # fmt: skip

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]})

    async def health(request: Request) -> Response:
        return Response(b"")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/messages", messages, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])  # fmt: skip


@pytest.fixture(scope="module")
def usage_upstream() -> Iterator[str]:
    """The FAKE upstream on a free port, in a thread: usage with cached tokens, a 500, a cut stream, a slow stream."""
    port = pick_free_port()
    server = uvicorn.Server(uvicorn.Config(_upstream_app(), host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the fake upstream did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _models(upstream: str) -> dict[str, Any]:
    return {"m": {"url": upstream}, "n": {"url": upstream}}


def _gateway(state_dir: Path, **usage: Any) -> dict[str, Any]:
    return {"api_keys": [KEY], "admin_keys": [ADMIN], "state_dir": str(state_dir), "usage": {**FAST, **usage}}


def _chat(model: str = "m", text: str = "hi", stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 7, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _post(url: str, rid: str, body: dict[str, Any], key: str = KEY, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, headers={**auth(key), "X-Request-Id": rid}, timeout=30)


def _rows(url: str, ids: list[str], timeout_s: float = 20) -> dict[str, dict[str, Any]]:
    """The ledger rows of ``ids`` in the database at ``url``, once all are there."""
    engine = create_engine(url)
    try:

        def rows() -> dict[str, dict[str, Any]]:
            try:
                with engine.connect() as conn:
                    return {row.request_id: dict(row._mapping) for row in conn.execute(select(usage_rows).where(usage_rows.c.request_id.in_(ids)))}
            except Exception:  # noqa: BLE001 - not created yet / server down: wait
                return {}

        (found,) = wait_until(
            lambda: (now,) if len(now := rows()) == len(ids) else None,
            lambda: f"rows missing: {sorted(set(ids) - set(rows()))}", timeout_s, every_s=0.05,
        )  # fmt: skip
        assert sorted(found) == sorted(ids), f"rows missing: {sorted(set(ids) - set(found))}"
        return found
    finally:
        engine.dispose()


def _sqlite(state_dir: Path) -> str:
    return f"sqlite:///{state_dir / 'usage.sqlite3'}"


# ------------------------------------------------------------------------------ through the gateway (SQLite)
@pytest.fixture(scope="module")
def ledger_gateway(usage_upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    state_dir = tmp_path_factory.mktemp("ledger-state")
    with serve(_models(usage_upstream), _gateway(state_dir)) as server:
        server.state_dir = state_dir
        yield server


def test_every_request_gets_a_row_with_the_usage_the_upstream_reported(ledger_gateway: Any) -> None:
    url = ledger_gateway.url
    assert _post(url, "r-plain", _chat()).status_code == 200
    with httpx.stream("POST", url + "/v1/chat/completions", json=_chat(stream=True), headers={**auth(), "X-Request-Id": "r-stream"}, timeout=30) as response:
        assert response.status_code == 200 and "[DONE]" in response.read().decode()
    messages = {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
    assert _post(url, "r-messages", messages, path="/v1/messages").status_code == 200
    assert "message_stop" in _post(url, "r-messages-stream", {**messages, "stream": True}, path="/v1/messages").text
    assert_openai_error(_post(url, "r-unknown-model", _chat(model="nope")), 404)
    assert_openai_error(_post(url, "r-bad-key", _chat(), key="wrong"), 401)
    assert _post(url, "r-upstream-500", _chat(text="FAIL")).status_code >= 500
    with httpx.stream("POST", url + "/v1/chat/completions", json=_chat(text="CUT", stream=True), headers={**auth(), "X-Request-Id": "r-cut"}, timeout=30) as response:
        assert response.status_code == 200
        response.read()  # the gateway ends the stream with an error event where the upstream cut it
    with httpx.stream("POST", url + "/v1/chat/completions", json=_chat(text="SLOW", stream=True), headers={**auth(), "X-Request-Id": "r-gone"}, timeout=30) as response:
        next(response.iter_lines())  # the client goes away after the first line
    ids = ["r-plain", "r-stream", "r-messages", "r-messages-stream", "r-unknown-model", "r-bad-key", "r-upstream-500", "r-cut", "r-gone"]
    rows = _rows(_sqlite(ledger_gateway.state_dir), ids)

    plain, stream = rows["r-plain"], rows["r-stream"]
    assert (plain["status"], plain["model"], plain["route"], plain["key_name"], plain["stream"], plain["error"]) == (200, "m", "/v1/chat/completions", None, False, None)
    assert (plain["prompt_tokens"], plain["completion_tokens"], plain["cached_tokens"]) == (11, 7, 4)
    assert plain["latency_ms"] > 0 and plain["ttft_ms"] is not None
    assert abs(plain["at"].replace(tzinfo=UTC).timestamp() - time.time()) < 60  # UTC wall clock (SQLite keeps it naive)
    assert (stream["status"], stream["stream"], stream["prompt_tokens"], stream["completion_tokens"], stream["cached_tokens"]) == (200, True, 11, 7, 4)
    assert stream["ttft_ms"] is not None and stream["ttft_ms"] <= stream["latency_ms"]
    anthropic = rows["r-messages"]
    # Anthropic's input_tokens leaves out the cache reads: the prompt is 13 + 2
    assert (anthropic["route"], anthropic["prompt_tokens"], anthropic["completion_tokens"], anthropic["cached_tokens"]) == ("/v1/messages", 15, 6, 2)
    # a stream that says a prompt of 0 did not say it: counted (this fake has no tokenizer: its bound, the body's bytes)
    said_nothing = rows["r-messages-stream"]
    assert said_nothing["completion_tokens"] == 1 and said_nothing["prompt_tokens"] >= len(json.dumps(messages)) // 2, said_nothing
    assert (rows["r-unknown-model"]["status"], rows["r-unknown-model"]["model"]) == (404, None)
    assert rows["r-unknown-model"]["error"]
    assert rows["r-bad-key"]["status"] == 401
    failed = rows["r-upstream-500"]
    assert failed["status"] >= 500 and failed["error"] and failed["model"] == "m" and failed["prompt_tokens"] is None
    cut = rows["r-cut"]
    assert (cut["status"], cut["stream"]) == (200, True) and cut["error"], cut
    gone = rows["r-gone"]
    assert gone["status"] in (200, 499) and gone["error"] == "client disconnected", gone


def test_per_key_prometheus_counters(ledger_gateway: Any) -> None:
    url = ledger_gateway.url
    before = httpx.get(url + "/metrics", headers=auth(ADMIN)).text  # per-key series: the admin's (a client key sees its own)
    for index in range(3):
        assert _post(url, f"prom-{index}", _chat(model="n")).status_code == 200
    text = httpx.get(url + "/metrics", headers=auth(ADMIN)).text
    requests = {"key": "unnamed", "model": "n", "status_class": "2xx"}
    assert (prometheus_value(text, "gateway_key_requests_total", requests) or 0) - (prometheus_value(before, "gateway_key_requests_total", requests) or 0) == 3
    prompt = {"key": "unnamed", "model": "n", "kind": "prompt"}
    assert (prometheus_value(text, "gateway_key_tokens_total", prompt) or 0) - (prometheus_value(before, "gateway_key_tokens_total", prompt) or 0) == 33
    assert prometheus_value(text, "gateway_usage_rows_dropped_total") == 0


def test_a_named_keys_rows_and_counters_carry_its_name(usage_upstream: str, tmp_path: Path) -> None:
    named = "sk-named-ledger-0123456789"
    gateway = {**_gateway(tmp_path), "keys": [{"name": "team-a", "key": named}]}
    with serve(_models(usage_upstream), gateway) as server:
        assert _post(server.url, "named-1", _chat(), key=named).status_code == 200
        assert _post(server.url, "plain-1", _chat()).status_code == 200
        rows = _rows(_sqlite(tmp_path), ["named-1", "plain-1"])
        text = httpx.get(server.url + "/metrics", headers=auth(ADMIN)).text
    assert rows["named-1"]["key_name"] == "team-a" and rows["plain-1"]["key_name"] is None
    assert prometheus_value(text, "gateway_key_requests_total", {"key": "team-a", "model": "m", "status_class": "2xx"}) == 1


def test_admin_usage_filters_and_groups_and_names_a_bad_parameter(ledger_gateway: Any, tmp_path: Path) -> None:
    url = ledger_gateway.url
    since = time.time()
    time.sleep(0.01)
    ids = [f"adm-m-{i}" for i in range(3)] + [f"adm-n-{i}" for i in range(2)]
    for rid in ids:
        assert _post(url, rid, _chat(model="m" if "-m-" in rid else "n")).status_code == 200
    assert _post(url, "adm-n-fail", _chat(model="n", text="FAIL")).status_code >= 500
    _rows(_sqlite(ledger_gateway.state_dir), [*ids, "adm-n-fail"])
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def usage(**params: Any) -> dict[str, Any]:
        response = httpx.get(url + "/admin/usage", params=params, headers=admin)
        assert response.status_code == 200, response.text
        return response.json()

    by_model = usage(since=str(since), group_by="model")
    assert by_model["filters"]["group_by"] == ["model"] and by_model["filters"]["since"].startswith(time.strftime("%Y-%m-%dT", time.gmtime(since)))
    assert [row for row in by_model["rows"] if row["model"] is not None] == [  # (None: these /admin/usage calls)
        {"model": "m", "requests": 3, "prompt_tokens": 33, "completion_tokens": 21, "cached_tokens": 12, "errors": 0},
        {"model": "n", "requests": 3, "prompt_tokens": 22, "completion_tokens": 14, "cached_tokens": 8, "errors": 1},
    ]
    assert usage(since=str(since), model="n")["rows"] == [{"requests": 3, "prompt_tokens": 22, "completion_tokens": 14, "cached_tokens": 8, "errors": 1}]
    day = time.strftime("%Y-%m-%d", time.gmtime())
    iso_since = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    grouped = usage(since=iso_since, group_by="day,key", model="m")["rows"]
    assert [(row["day"], row["key"], row["requests"]) for row in grouped] == [(day, None, 3)]
    assert usage(until=str(since), since=str(since - 3600), model="n", key="nobody")["rows"][0]["requests"] == 0
    assert usage(group_by="model", key="nobody")["rows"] == []

    for params, param in [({"group_by": "model,colour"}, "group_by"), ({"since": "yesterday"}, "since"), ({"until": "2024-13-01"}, "until"),
                          ({"since": "2025-01-02", "until": "2025-01-01"}, "until"), ({"sort": "x"}, "sort")]:  # fmt: skip
        body = assert_openai_error(httpx.get(url + "/admin/usage", params=params, headers=admin), 400, "invalid_parameter")
        assert body["error"]["param"] == param and param in body["error"]["message"], body
    assert_openai_error(httpx.get(url + "/admin/usage", headers=auth()), 401)


def test_the_cli_reads_the_database_as_a_table_or_csv(ledger_gateway: Any, usage_upstream: str, tmp_path: Path) -> None:
    since = time.time()
    time.sleep(0.01)
    ids = ["cli-m-0", "cli-m-1", "cli-n-0"]
    for rid in ids:
        assert _post(ledger_gateway.url, rid, _chat(model=rid.split("-")[1])).status_code == 200
    _rows(_sqlite(ledger_gateway.state_dir), ids)
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"models": _models(usage_upstream), "gateway": {"state_dir": str(ledger_gateway.state_dir)}}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "usage", "--config", str(config), *args], capture_output=True, text=True, timeout=60, env=env, check=False)

    result = cli("--since", str(since), "--group-by", "model,key", "--csv")
    assert result.returncode == 0, result.stderr
    assert [row for row in csv.DictReader(io.StringIO(result.stdout)) if row["model"]] == [
        {"model": "m", "key": "", "requests": "2", "prompt_tokens": "22", "completion_tokens": "14", "cached_tokens": "8", "errors": "0"},
        {"model": "n", "key": "", "requests": "1", "prompt_tokens": "11", "completion_tokens": "7", "cached_tokens": "4", "errors": "0"},
    ]
    table = cli("--since", str(since), "--model", "m")
    assert table.returncode == 0 and "requests" in table.stdout and " 22 " in table.stdout, table.stdout
    bad = cli("--model", "m", "--group-by", "model,hour")
    assert bad.returncode == 2, bad
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --group-by: 'hour'") and "Traceback" not in bad.stderr, bad.stderr


def test_rows_are_written_on_sigterm_by_every_worker_process(usage_upstream: str, tmp_path: Path) -> None:
    """Rows buffered for an hour (flush_interval_s) reach the database when the gateway stops on SIGTERM: the
    lifespan shutdown of each worker process (and of the control) flushes its ledger."""
    state_dir = tmp_path / "state"
    gateway = {**_gateway(state_dir, flush_interval_s=3600, batch_rows=100_000), "workers": 2}
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"models": _models(usage_upstream), "gateway": gateway}))
    server = ServerProcess([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / "gateway.log")
    try:
        server.wait_http("/health", timeout_s=60)
        ids = [f"term-{i}" for i in range(24)]
        for index, rid in enumerate(ids):
            assert _post(server.url, rid, _chat(stream=index % 3 == 0)).status_code == 200
        workers = {httpx.get(server.url + "/health").headers.get("x-gateway-worker") for _ in range(20)}
        os.kill(server.pid, signal.SIGTERM)  # the control process only, as a service manager does
        assert server.proc.wait(60) == 0, server.log(3000)
    finally:
        server.stop()
    rows = _rows(_sqlite(state_dir), ids, timeout_s=1)
    assert {row["status"] for row in rows.values()} == {200} and all(row["prompt_tokens"] == 11 for row in rows.values())
    assert len(workers) == 2, f"the requests reached one worker only: {workers}"


def test_a_full_buffer_drops_the_oldest_rows_and_counts_them(usage_upstream: str, tmp_path: Path) -> None:
    """The database cannot be opened (its directory is a file): requests are answered, rows wait in memory up to
    max_buffer_rows, the oldest beyond are dropped and counted; once it can be opened, the kept rows arrive."""
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    url = f"sqlite:///{blocker / 'usage.sqlite3'}"
    gateway = _gateway(tmp_path / "state", max_buffer_rows=5, database_url=url)
    with serve(_models(usage_upstream), gateway) as server:
        ids = [f"drop-{i}" for i in range(8)]
        for rid in ids:
            assert _post(server.url, rid, _chat()).status_code == 200
        metrics = httpx.get(server.url + "/metrics", headers={**auth(ADMIN), "X-Request-Id": "drop-metrics"}).text
        assert prometheus_value(metrics, "gateway_usage_rows_dropped_total") == 3
        time.sleep(0.1)
        assert server.state.ledger.buffered == 5  # drop-4 .. drop-7 and the /metrics request (its row pushed drop-3 out)
        blocker.unlink()  # the database can be created now: the writer's next retry writes the newest five
        kept = [*ids[4:], "drop-metrics"]
        _rows(url, kept, timeout_s=30)
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(select(usage_rows.c.request_id).order_by(usage_rows.c.id)).scalars().all() == kept  # the newest, in order
    engine.dispose()


# ------------------------------------------------------------------------------ PostgreSQL (a real server)
def test_postgres_stopped_mid_run_loses_no_request(usage_upstream: str, postgres: PostgresServer, tmp_path: Path) -> None:
    gateway = _gateway(tmp_path / "state", database_url=postgres.url)
    with serve(_models(usage_upstream), gateway) as server:
        first = [f"pg-up-{i}" for i in range(4)]
        for rid in first:
            assert _post(server.url, rid, _chat()).status_code == 200
        _rows(postgres.url, first)
        postgres.stop()
        try:
            down = [f"pg-down-{i}" for i in range(6)]
            for index, rid in enumerate(down):  # served while the database is down, streams too
                started = time.monotonic()
                assert _post(server.url, rid, _chat(stream=index % 2 == 0)).status_code == 200
                assert time.monotonic() - started < 2, "a request waited on the database"
            ledger = server.state.ledger
            failed = ledger.failed_writes
            # a write that failed after every row was recorded: the rows are back in the buffer (between two tries)
            wait_until(lambda: ledger.failed_writes > failed and ledger.buffered == len(down), lambda: f"buffered {ledger.buffered}", 30, every_s=0.01)
        finally:
            postgres.start()
        rows = _rows(postgres.url, first + down, timeout_s=40)
        assert all(row["status"] == 200 and row["prompt_tokens"] == 11 for row in rows.values())
        totals = UsageReader(postgres.url)
        try:
            grouped = totals.read(parse_query(None, "m", None, None, "day,model"))
        finally:
            totals.close()
        assert grouped[-1]["day"] == time.strftime("%Y-%m-%d", time.gmtime()) and grouped[-1]["requests"] >= 10


def test_postgres_takes_the_row_of_a_path_with_nul_and_every_row_after_it(usage_upstream: str, postgres: PostgresServer, tmp_path: Path) -> None:
    """``GET /%00``, unauthenticated (401): PostgreSQL's text cannot hold a NUL; its row is stored with U+FFFD in its
    place, and the rows after it are written (before, the writer retried that batch forever and wrote nothing more)."""
    gateway = _gateway(tmp_path / "state", database_url=postgres.url)
    with serve(_models(usage_upstream), gateway) as server:
        nul = httpx.get(server.url + "/%00", headers={"X-Request-Id": "pg-nul"}, timeout=30)
        assert nul.status_code == 401, nul.text
        after = [f"pg-after-nul-{i}" for i in range(3)]
        for rid in after:
            assert _post(server.url, rid, _chat()).status_code == 200
        rows = _rows(postgres.url, ["pg-nul", *after])
        assert rows["pg-nul"]["status"] == 401 and rows["pg-nul"]["route"] == "/\ufffd", rows["pg-nul"]
        metrics = httpx.get(server.url + "/metrics", headers=auth(ADMIN), timeout=30).text
        assert prometheus_value(metrics, "gateway_usage_rows_refused_total") == 0  # stored, not set aside


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_row_the_database_refuses_is_set_aside_and_the_rows_behind_it_are_written(
    database: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A row no retry can write (a token count past the column's range, refused by SQLite's driver and by
    PostgreSQL) is set aside, counted and logged once; the rows of its batch and after it are written."""
    url = f"sqlite:///{tmp_path / 'usage.sqlite3'}" if database == "sqlite" else request.getfixturevalue("postgres").url
    rows = [_row(f"{database}-aside-{index}") for index in range(10)]
    for bad in (rows[2], rows[7]):
        bad.prompt_tokens = 2**70
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="WARNING", format="{message}")
    registry = CollectorRegistry()
    refused = Counter("refused", "rows set aside", registry=registry)

    async def run() -> tuple[bool, bool]:
        ledger = Ledger(UsageSettings(batch_rows=5), url, refused=refused)
        try:
            for row in rows:
                ledger.record(row)
            first = await ledger.flush()
            late = _row(f"{database}-aside-late")
            late.completion_tokens = 2**70
            ledger.record(late)
            ledger.record(_row(f"{database}-aside-last"))
            return first, await ledger.flush()
        finally:
            await ledger.close()

    try:
        assert asyncio.run(run()) == (True, True)
    finally:
        logger.remove(sink)
    written = [row.request_id for index, row in enumerate(rows) if index not in (2, 7)] + [f"{database}-aside-last"]
    assert sorted(_rows(url, written)) == sorted(written)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            query = select(usage_rows.c.request_id).where(usage_rows.c.request_id.like(f"{database}-aside-%")).order_by(usage_rows.c.id)
            assert conn.execute(query).scalars().all() == written
    finally:
        engine.dispose()
    assert registry.get_sample_value("refused_total") == 3
    said = [line for line in lines if "refused the row" in line]
    assert len(said) == 1 and f"'{database}-aside-2'" in said[0], lines


def test_postgres_schema_is_versioned_and_a_newer_one_is_refused(postgres: PostgresServer) -> None:
    engine = open_engine(postgres.url, write=True)
    try:
        assert migrate(engine) == LATEST and migrate(engine) == LATEST  # applied once; a second open changes nothing
        with engine.begin() as conn:
            assert conn.execute(select(schema_version.c.version)).scalars().all() == [LATEST]
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ the parts alone
def _row(rid: str) -> UsageRow:
    return UsageRow(time.time(), "team-a", "m", "/v1/chat/completions", 1, 2, None, 200, 1.0, None, rid, None, False, None)


def test_a_database_of_a_newer_schema_is_left_alone_and_the_rows_wait(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'usage.sqlite3'}"
    engine = open_engine(url, write=True)
    assert migrate(engine) == LATEST and migrate(engine) == LATEST
    with engine.begin() as conn:
        conn.execute(schema_version.update().values(version=LATEST + 1))
    with pytest.raises(SchemaError, match="newer"):
        migrate(engine)
    engine.dispose()

    async def run() -> tuple[bool, int]:
        ledger = Ledger(UsageSettings(), url)
        ledger.record(_row("newer-1"))
        return await ledger.flush(), ledger.buffered

    assert asyncio.run(run()) == (False, 1)


def test_sqlite_rows_read_back_as_sqlalchemy_writes_them_and_a_big_batch_is_written_whole(tmp_path: Path) -> None:
    """The SQLite writer's many-rows INSERT (:mod:`gateway.tenants.ledger`) stores what SQLAlchemy's own insert of
    the same rows stores (times, flags, NULLs, truncation), also past one statement's rows."""
    full = UsageRow(
        time.time(), "team-b", "m", "/v1/" + "r" * 400, 7, 3, 5, 499, 12.5, 0.25, "full-1", 2, True, "cut: " + "e" * 400
    )
    rows = [full, *(_row(f"big-{index}") for index in range(2 * ledger_module.SQLITE_ROWS_PER_STATEMENT + 10))]
    url = f"sqlite:///{tmp_path / 'usage.sqlite3'}"

    async def run() -> bool:
        ledger = Ledger(UsageSettings(batch_rows=len(rows)), url)
        for row in rows:
            ledger.record(row)
        return await ledger.flush()

    assert asyncio.run(run())
    reference = open_engine(f"sqlite:///{tmp_path / 'reference.sqlite3'}", write=True)
    written = open_engine(url, write=False)
    try:
        migrate(reference)
        with reference.begin() as conn:
            conn.execute(usage_rows.insert(), [ledger_module._values(row) for row in rows])
        columns = [column for column in usage_rows.columns if column.name != "id"]
        with reference.connect() as a, written.connect() as b:
            expected = a.execute(select(*columns).order_by(usage_rows.c.id)).all()
            got = b.execute(select(*columns).order_by(usage_rows.c.id)).all()
        assert len(got) == len(rows) and got == expected
        assert got[0].stream is True and got[0].at.tzinfo is None and abs(got[0].at.replace(tzinfo=UTC).timestamp() - full.at) < 1e-5
        assert got[1].cached_tokens is None and got[1].stream is False
    finally:
        reference.dispose()
        written.dispose()


@pytest.mark.parametrize(
    "at",
    [1796281598.9999996, 1796281598.9999994, 1796281598.0000005, 1796281598.0000015, 1796281599.0, 1767225599.9999999, 1796281598.123456],
)
def test_the_sqlite_writers_times_are_datetimes_own_at_the_microsecond_edges(at: float) -> None:
    """Its cheap formatting rounds as ``datetime.fromtimestamp`` does (half to even), carrying into the next second
    (here also the next year) when the microseconds round up to a million."""
    assert ledger_module._sqlite_time(at) == datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def test_two_writers_share_one_sqlite_file(tmp_path: Path) -> None:
    """As two worker processes do: each its own engine and buffer, one file, every row kept."""
    url = f"sqlite:///{tmp_path / 'usage.sqlite3'}"

    async def run() -> None:
        ledgers = [Ledger(UsageSettings(flush_interval_s=0.01, batch_rows=7), url) for _ in range(2)]
        for ledger in ledgers:
            await ledger.start()
        for index in range(200):
            ledgers[index % 2].record(_row(f"two-{index}"))
            if index % 20 == 0:
                await asyncio.sleep(0.005)
        for ledger in ledgers:
            await ledger.close()

    asyncio.run(run())
    reader = UsageReader(url)
    try:
        assert reader.read(parse_query("team-a", None, None, None, None)) == [
            {"requests": 200, "prompt_tokens": 200, "completion_tokens": 400, "cached_tokens": 0, "errors": 0}
        ]
    finally:
        reader.close()


def test_cached_tokens_come_from_each_dialects_usage() -> None:
    info = RequestInfo("r", "POST", "/v1/chat/completions")
    info.set_usage({"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 8}})
    assert (info.prompt_tokens, info.cached_tokens) == (9, 8)
    info.set_usage({"completion_tokens": 2})  # a later usage without the detail keeps it
    assert (info.completion_tokens, info.cached_tokens) == (2, 8)
    responses = RequestInfo("r", "POST", "/v1/responses")
    responses.set_usage({"input_tokens": 5, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 3}})
    anthropic = RequestInfo("r", "POST", "/v1/messages")
    anthropic.set_usage({"input_tokens": 5, "output_tokens": 1, "cache_read_input_tokens": 4})
    assert (responses.cached_tokens, anthropic.cached_tokens) == (3, 4)
    # the prompt: OpenAI's and Responses' counts include their cached tokens; Anthropic's input_tokens leaves out what
    # was read from or written to the cache (SGLang's Messages: a prompt wholly in the prefix cache says input_tokens 0)
    assert (responses.prompt_tokens, anthropic.prompt_tokens) == (5, 9)
    written = RequestInfo("r", "POST", "/v1/messages")
    written.set_usage({"input_tokens": 0, "output_tokens": 1, "cache_read_input_tokens": 6, "cache_creation_input_tokens": 2})
    written.set_usage({"output_tokens": 3})  # message_delta: no input count, the prompt stays
    assert (written.prompt_tokens, written.completion_tokens) == (8, 3)
    plain = RequestInfo("r", "POST", "/v1/chat/completions")
    plain.set_usage({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None})
    assert plain.cached_tokens is None


@pytest.mark.parametrize(
    ("usage", "message"),
    [
        ({"database_url": "mysql://db/usage"}, "deploy.yaml: gateway.usage.database_url: database_url must be sqlite:///<path> or postgresql+psycopg://"),
        ({"batch_rows": 0}, "deploy.yaml: gateway.usage.batch_rows: Input should be greater than or equal to 1"),
        ({"flush_interval_s": 0}, "deploy.yaml: gateway.usage.flush_interval_s: Input should be greater than 0"),
        ({"max_buffer_rows": -1}, "deploy.yaml: gateway.usage.max_buffer_rows: Input should be greater than or equal to 1"),
        ({"enable": True}, "deploy.yaml: gateway.usage.enable: unknown key"),
    ],
)
def test_usage_settings_are_validated_with_a_message_naming_the_key(usage: dict[str, Any], message: str) -> None:
    deployment = parse_config({"models": {"a": {"url": "http://127.0.0.1:1"}}, "gateway": {"usage": usage}}, "deploy.yaml")
    with pytest.raises(ConfigError) as caught:
        gateway_settings(deployment)
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_postgresql_url_means_psycopg_and_its_password_is_not_printed() -> None:
    deployment = parse_config({"models": {"a": {"url": "http://127.0.0.1:1"}}, "gateway": {"usage": {"database_url": "postgresql://u:s3cret@db/usage"}}})
    settings = gateway_settings(deployment)
    assert settings.usage.database_url is not None
    assert settings.usage.database_url.get_secret_value() == "postgresql+psycopg://u:s3cret@db/usage"
    assert "s3cret" not in repr(settings)


def test_a_sigkilled_worker_loses_at_most_the_rows_of_its_requests_in_flight(usage_upstream: str, tmp_path: Path) -> None:
    """Workers hand each row to the control process as its request ends: with rows held for an hour before a write
    (flush_interval_s), SIGKILL of a worker under load loses no row of an answered request beyond the requests that
    failed with it (those it had in flight, or had accepted)."""
    state_dir = tmp_path / "state"
    gateway = {**_gateway(state_dir, flush_interval_s=3600, batch_rows=100_000), "workers": 2}
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"models": _models(usage_upstream), "gateway": gateway}))
    server = ServerProcess([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / "gateway.log")
    answered: list[str] = []
    failed: list[str] = []
    stop = threading.Event()

    def client(index: int) -> None:
        with httpx.Client(timeout=30) as http:
            count = 0
            while not stop.is_set():
                rid = f"kill-{index}-{count}"
                count += 1
                try:
                    ok = http.post(server.url + "/v1/chat/completions", json=_chat(), headers={**auth(), "X-Request-Id": rid}).status_code == 200
                except httpx.HTTPError:
                    ok = False
                (answered if ok else failed).append(rid)

    try:
        server.wait_http("/health", timeout_s=60)
        workers = psutil.Process(server.pid).children()
        assert len(workers) == 2, workers
        threads = [threading.Thread(target=client, args=(index,)) for index in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        workers[0].kill()
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(30)
        os.kill(server.pid, signal.SIGTERM)  # the control writes what it holds
        assert server.proc.wait(60) == 0, server.log(3000)
    finally:
        stop.set()
        server.stop()
    engine = create_engine(_sqlite(state_dir))
    with engine.connect() as conn:
        written = set(conn.execute(select(usage_rows.c.request_id)).scalars())
    engine.dispose()
    missing = [rid for rid in answered if rid not in written]
    assert len(answered) > 100, len(answered)
    assert len(missing) <= len(failed), (len(missing), len(failed), len(answered))


def test_rows_that_arrive_while_a_batch_is_written_wait_for_the_next_one(tmp_path: Path) -> None:
    """A request ends during every write (as at a steady rate): the writer still writes whole batches, each of the
    rows buffered when its write began, then waits the interval, not a transaction per row or two that came
    meanwhile. Every row is written by the close."""
    url = f"sqlite:///{tmp_path / 'usage.sqlite3'}"
    written: list[int] = []

    async def run() -> None:
        ledger = Ledger(UsageSettings(flush_interval_s=0.2, batch_rows=50), url)
        write_batch = ledger._write_batch

        async def a_request_ends_meanwhile(batch: list[UsageRow]) -> None:
            written.append(len(batch))
            if len(written) <= 8:  # (not forever: the close writes until nothing is left)
                ledger.record(_row(f"meanwhile-{len(written)}"))
            await write_batch(batch)

        ledger._write_batch = a_request_ends_meanwhile  # type: ignore[method-assign]
        await ledger.start()
        began = time.monotonic()
        for index in range(120):
            ledger.record(_row(f"steady-{index}"))
            if index % 10 == 9:
                await asyncio.sleep(0.05)
        elapsed.append(time.monotonic() - began)
        steady.extend(written)
        await ledger.close()

    steady: list[int] = []
    elapsed: list[float] = []
    asyncio.run(run())
    # One write per interval (the first is the start's, which opens the database: what came by then), each of the rows
    # of that interval; the old writer: after each write, one more transaction for the row or two that came meanwhile.
    assert 2 <= len(steady) <= elapsed[0] / 0.2 + 2 and min(steady[1:]) >= 5, (steady, elapsed)
    reader = UsageReader(url)
    try:
        assert reader.read(parse_query("team-a", None, None, None, None))[0]["requests"] == 120 + min(len(written), 8)
    finally:
        reader.close()
