"""Stored responses belong to the key that created them, and outlive the gateway process.

Two keys (A and B), real ``openai`` SDK clients, the session's real CPU engine (started with
``enable_response_store``) served by URL: B can neither read, cancel nor continue A's responses (it gets
the 404 of an id nobody created), nor choose a response id; a restarted gateway with the same state
directory still routes A's responses and still refuses them to B; malformed ids get the engine's 400.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from launch.model_info import vocab_size
from launch.process import EngineProcess
from tests.gateway_server import GatewayServer, serve

KEY_A, KEY_B = "owner-key-a", "owner-key-b"


@contextmanager
def _gateway(engine: EngineProcess, state_dir: Path, url: str | None = None) -> Iterator[GatewayServer]:
    vocab = vocab_size(engine.config.model_path)
    models = {"tiny": {"url": url or engine.url, "vocab_size": vocab}, "second": {"url": engine.url, "served_model_name": "tiny", "vocab_size": vocab}}
    with serve(models, {"api_keys": [KEY_A, KEY_B], "state_dir": str(state_dir)}) as server:
        yield server


def _sdk(server: GatewayServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-state")


@pytest.fixture(scope="module")
def server(tiny_engine: EngineProcess, state_dir: Path) -> Iterator[GatewayServer]:
    with _gateway(tiny_engine, state_dir) as running:
        yield running


def _create(sdk: openai.OpenAI, text: str, **options: Any) -> Any:
    return sdk.responses.create(model="tiny", input=text, max_output_tokens=4, temperature=0, **options)


def _streamed(sdk: openai.OpenAI, text: str) -> Any:
    events = list(sdk.responses.create(model="tiny", input=text, max_output_tokens=4, temperature=0, stream=True))
    return events[-1].response


def _absent_like(call: Callable[[str], Any], theirs: str) -> dict[str, Any]:
    """The 404 ``call`` gets for ``theirs``: exactly the one it gets for an id nobody created (ids aside)."""
    nobody = "resp_" + "0" * 32
    errors = []
    for response_id in (theirs, nobody):
        with pytest.raises(openai.NotFoundError) as caught:
            call(response_id)
        errors.append({**caught.value.body, "message": caught.value.body["message"].replace(response_id, "ID")})
    assert errors[0] == errors[1] and errors[0]["code"] == "response_not_found", errors
    return errors[0]


def test_another_key_cannot_read_cancel_or_continue_a_response(server: GatewayServer) -> None:
    a, b = _sdk(server, KEY_A), _sdk(server, KEY_B)
    plain, streamed = _create(a, "Remember this."), _streamed(a, "Remember that.")
    for mine in (plain, streamed):
        _absent_like(b.responses.retrieve, mine.id)
        _absent_like(b.responses.cancel, mine.id)
        body = _absent_like(lambda rid: _create(b, "What did they say?", previous_response_id=rid), mine.id)
        assert body["param"] == "previous_response_id"
        assert a.responses.retrieve(mine.id).output_text == mine.output_text  # the owner still reads it
        assert _create(a, "Go on.", previous_response_id=mine.id).previous_response_id == mine.id


def test_a_client_cannot_choose_a_response_id(server: GatewayServer) -> None:
    a, b = _sdk(server, KEY_A), _sdk(server, KEY_B)
    mine = _create(a, "Remember this.")
    for chosen in (mine.id, "../../flush_cache", "resp_" + "x" * 5000):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                b.responses.create(model="tiny", input="Overwrite.", max_output_tokens=4, stream=stream, extra_body={"request_id": chosen})
            assert refused.value.body["param"] == "request_id" and "request_id" in refused.value.body["message"]
            assert chosen not in refused.value.body["message"]
    again = a.responses.retrieve(mine.id)  # not overwritten: still A's own output
    assert again.id == mine.id and again.output_text == mine.output_text


def test_malformed_ids_get_the_engines_400(server: GatewayServer, tiny_engine: EngineProcess) -> None:
    """What SGLang answers an id without its ``resp_`` prefix, word for word, in the gateway's OpenAI shape."""
    engine = httpx.Client(base_url=tiny_engine.url, headers=tiny_engine.auth_headers(), timeout=60)
    gateway = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60)
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "previous_response_id": "bad"}
    with engine, gateway:
        for method, path, json in (("GET", "/v1/responses/bad", None), ("POST", "/v1/responses/bad/cancel", None), ("POST", "/v1/responses", body)):
            theirs, ours = engine.request(method, path, json=json), gateway.request(method, path, json=json)
            assert theirs.status_code == ours.status_code == 400, (path, theirs.text, ours.text)
            expected, got = theirs.json()["error"], ours.json()["error"]
            assert got["message"] == expected["message"] == "Invalid 'response_id': 'bad'. Expected an ID that begins with 'resp'."
            assert (got["type"], got["param"]) == (expected["type"], expected["param"]) and got["code"] == "invalid_request"


def test_a_restarted_gateway_keeps_owners_and_engines(tiny_engine: EngineProcess, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with _gateway(tiny_engine, state) as first:
        plain, streamed = _create(_sdk(first, KEY_A), "Remember this."), _streamed(_sdk(first, KEY_A), "Remember that.")
        other_model = _sdk(first, KEY_A).responses.create(model="second", input="Elsewhere.", max_output_tokens=4)
    with _gateway(tiny_engine, state) as second:  # nothing in memory: everything from the state dir
        a, b = _sdk(second, KEY_A), _sdk(second, KEY_B)
        for mine in (plain, streamed):
            assert a.responses.retrieve(mine.id).output_text == mine.output_text
            assert _create(a, "Go on.", previous_response_id=mine.id).previous_response_id == mine.id
            _absent_like(b.responses.retrieve, mine.id)
            _absent_like(lambda rid: _create(b, "And?", previous_response_id=rid), mine.id)
        with pytest.raises(openai.BadRequestError) as wrong_model:  # which model holds it survived too
            _create(a, "x", previous_response_id=other_model.id)
        assert wrong_model.value.body["param"] == "previous_response_id"
    moved = tiny_engine.url.replace("127.0.0.1", "localhost")  # the same engine under another URL: another backend
    with _gateway(tiny_engine, state, url=moved) as third:
        with pytest.raises(openai.NotFoundError) as gone:
            _sdk(third, KEY_A).responses.retrieve(plain.id)
        assert "gone" in gone.value.body["message"] and gone.value.body["code"] == "response_not_found"
        _absent_like(_sdk(third, KEY_B).responses.retrieve, plain.id)  # still nothing to B, not even "gone"
