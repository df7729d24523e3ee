"""``batch_predict(..., via="batch")``, ``submit_batch`` and ``batch_results``: a model in URL mode hands its prompts to
the gateway's batch API as one job (a FAKE engine behind an in-process gateway with a state_dir), which a new client
(a restarted kernel) finds by its id; the results are the direct path's, in input order."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pandas as pd
import pytest
from loguru import logger

from model_code import batch_predict, batch_results, submit_batch
from model_code.batch import _line_result
from model_code.client import EngineClient, LogTimeClient
from model_code.errors import BadRequestError, EngineRequestError, OverloadedError
from model_code.replica_set import Replica, ReplicaSet
from model_code.target import ModelCodeSettings
from tests.fake_engine import running_fake_engine
from tests.gateway_server import GatewayServer, serve

ALPHA, OTHER_ONLY = "sk-alpha", "sk-other-only"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "prompt": {"type": "string"}}}
PARAMS = {"max_tokens": 3, "temperature": 0.0}


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_fake_engine(tmp_path_factory.mktemp("fake"), env={"FAKE_ENGINE_TOKEN_S": "0.002"}) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(fake: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    settings = {
        "keys": [{"name": "alpha", "key": ALPHA, "models": ["m"]}, {"name": "other-only", "key": OTHER_ONLY, "models": ["other"]}],
        "state_dir": str(tmp_path_factory.mktemp("state")),
        "batches": {"max_concurrency": 2, "poll_interval_s": 0.2, "retry_backoff_s": 0.1},
    }  # fmt: skip
    with serve({"m": {"url": fake}, "other": {"url": fake}}, settings) as server:
        yield server


def url_client(url: str, key: str = ALPHA, engine: Any = None) -> EngineClient:
    """A client of model ``m`` in URL mode at ``url`` (``engine``: a stand-in that makes it a managed one), no engine started."""
    settings = ModelCodeSettings(tracing="off")
    return EngineClient("m", ReplicaSet([Replica(0, url, key, settings, engine)]), settings)


def batch_ids(gateway: GatewayServer) -> list[str]:
    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key=ALPHA, max_retries=0)
    return [batch.id for batch in sdk.batches.list(limit=100).data]


def test_via_batch_gives_the_direct_results_in_input_order(gateway: GatewayServer) -> None:
    client = url_client(gateway.url)
    frame = pd.DataFrame({"prompt": [f"review {i}" for i in range(5)], "row": range(5)})
    kwargs: dict[str, Any] = {"system_prompt": "Grade it.", "json_schema": SCHEMA, "params": PARAMS}
    direct = batch_predict(client, frame, **kwargs)
    before = batch_ids(gateway)
    via_batch = batch_predict(client, frame, via="batch", **kwargs)
    assert len(batch_ids(gateway)) == len(before) + 1  # one job of the gateway's batch API, not direct calls
    assert via_batch.to_dict("records") == direct.to_dict("records")
    assert list(via_batch["row"]) == list(range(5))
    assert [parsed["prompt"] for parsed in via_batch["parsed"]] == list(frame["prompt"])  # each row its own answer
    assert via_batch["error"].isna().all() and all(usage["completion_tokens"] == 3 for usage in via_batch["usage"])
    listed = batch_predict(client, ["a", "b"], params=PARAMS, via="batch")  # no schema: text, nothing parsed
    assert listed == batch_predict(client, ["a", "b"], params=PARAMS)
    assert [(r["prompt"], r["output"], r["parsed"]) for r in listed] == [("a", "tok tok tok ", None), ("b", "tok tok tok ", None)]


def test_a_new_client_gets_the_results_of_a_submitted_batch(gateway: GatewayServer) -> None:
    prompts = [f"ticket {i}" for i in range(4)]
    logged: list[str] = []
    sink = logger.add(lambda message: logged.append(str(message)), format="{message}")
    try:
        batch_id = submit_batch(url_client(gateway.url), prompts, json_schema=SCHEMA, params=PARAMS)
    finally:
        logger.remove(sink)
    assert batch_id.startswith("batch") and any(batch_id in line for line in logged), logged  # findable after a restart
    restarted = url_client(gateway.url)  # the kernel restarted: a new client, nothing but the id
    results = batch_results(restarted, batch_id)
    assert [r["prompt"] for r in results] == prompts  # read back from the batch's input file
    assert [r["parsed"] for r in results] == [{"answer": "tok tok tok", "prompt": p} for p in prompts]
    assert results == batch_predict(restarted, prompts, json_schema=SCHEMA, params=PARAMS)
    assert batch_results(restarted, batch_id, wait=False) == results  # ended: no wait needed


def test_failed_lines_are_recorded_or_raised(gateway: GatewayServer) -> None:
    client = url_client(gateway.url)
    prompts = [f"slow {i}" for i in range(20)]
    batch_id = submit_batch(client, prompts, params={"max_tokens": 100})  # ~0.2 s a line, 2 at a time
    assert batch_results(client, batch_id, wait=False) is None  # still running
    openai.OpenAI(base_url=gateway.url + "/v1", api_key=ALPHA, max_retries=0).batches.cancel(batch_id)
    recorded = batch_results(client, batch_id, prompts, on_error="record")
    assert [r["prompt"] for r in recorded] == prompts
    never_sent = [r for r in recorded if r["error"] is not None]
    assert never_sent and all("batch_cancelled" in r["error"] and r["output"] is None for r in never_sent)
    with pytest.raises(EngineRequestError, match="batch_cancelled"):
        batch_results(client, batch_id, on_error="raise")


def test_a_failed_line_is_the_typed_error_of_its_status() -> None:
    line = {"custom_id": "0", "response": {"status_code": 429, "body": {"error": {"message": "slow down"}}}, "error": {"code": "x", "message": "m"}}
    batch = types.SimpleNamespace(id="batch_1", status="completed")
    with pytest.raises(OverloadedError, match="engine answered HTTP 429: slow down"):  # what the direct path raises for a 429
        _line_result("p", line, False, "raise", batch)
    assert _line_result("p", line, False, "record", batch)["error"] == "engine answered HTTP 429: slow down"
    assert "without a result" in _line_result("p", None, False, "record", batch)["error"]


def test_a_file_the_gateway_refuses_raises_even_when_recording(gateway: GatewayServer) -> None:
    before = batch_ids(gateway)
    with pytest.raises(BadRequestError, match="model") as refused:  # the key may not use model m: the create is refused
        batch_predict(url_client(gateway.url, key=OTHER_ONLY), ["a", "b"], params=PARAMS, via="batch", on_error="record")
    assert refused.value.engine_status == 400
    assert batch_ids(gateway) == before


def test_via_batch_needs_a_gateway_with_the_batch_api(fake: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'direct', 'batch'"):
        batch_predict(url_client(fake), ["a"], via="nonsense")
    for managed in (url_client(fake, engine=types.SimpleNamespace()), LogTimeClient("m")):
        with pytest.raises(BadRequestError, match="URL mode"):
            batch_predict(managed, ["a"], via="batch")
    settings = {"keys": [{"name": "alpha", "key": ALPHA, "models": ["m"]}], "state_dir": str(tmp_path), "batches": {"enabled": False}}
    with serve({"m": {"url": fake}}, settings) as off:
        with pytest.raises(BadRequestError, match="batches_off") as refused:
            submit_batch(url_client(off.url), ["a"], params=PARAMS)
    assert refused.value.engine_status == 404
