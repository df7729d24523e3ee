"""Client mistakes that reach the real SGLang engine: 400 in the route's dialect, not an engine failure.

SGLang 0.5.23 answers each of these with a 500 (see :mod:`gateway.core.client_mistakes`); none of them harms the
engine, so they run on the session's ``tiny_engine``. What the gateway must do: answer 400 with a one-line
message naming the field, count a 400 (not a 502) in its metrics, and keep the engine's words for its log.
Also here: a validation dump whose location holds ")" or "]", and /v1/score's error body, which has the shape
of the engine's own (SGLang's clients read ``body["type"] == "BadRequestError"``).
"""

from __future__ import annotations

import json

import httpx

from launch.process import EngineProcess
from tests.admin_client import prometheus_value
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import KEY, GatewayServer, auth

HELLO = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SELF_REF = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
MISTAKES = [  # (route, fields, the param blamed) - each answered 500 by the engine itself
    (CHAT, {"stop_regex": "("}, "stop_regex"),
    (CHAT, {"stop_regex": "(", "stream": True}, "stop_regex"),  # refused before the stream starts
    (COMPLETIONS, {"stop_regex": "[z-a]"}, "stop_regex"),
    (CHAT, {"ebnf": "root ::= root"}, "ebnf"),  # refused by the guard first (no rule of it matches any text)
    (CHAT, {"response_format": SELF_REF}, "response_format"),
    (COMPLETIONS, {"json_schema": json.dumps({"$ref": "#"})}, "json_schema"),
    (CHAT, {"chat_template_kwargs": {"tools": 5}}, "chat_template_kwargs.tools"),
    (CHAT, {"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs.messages"),
]


def _count(gateway: GatewayServer, route: str, status: str) -> float:
    text = httpx.get(gateway.url + "/metrics", headers=auth(KEY), timeout=30).text
    return prometheus_value(text, "gateway_requests_total", {"model": "tiny", "route": route, "status": status}) or 0.0


def _body(path: str, fields: dict) -> dict:
    base = {"model": "tiny", "max_tokens": 3}
    return {**base, **({"messages": HELLO} if path == CHAT else {"prompt": "hi"}), **fields}


def test_client_mistakes_are_400_and_not_engine_failures(gateway: GatewayServer, tiny_engine: EngineProcess) -> None:
    before = {(route, status): _count(gateway, route, status) for route in (CHAT, COMPLETIONS) for status in ("400", "502")}
    with httpx.Client(base_url=gateway.url, headers=auth(), timeout=120) as http:
        for path, fields, param in MISTAKES:
            straight = httpx.post(tiny_engine.url + path, json=_body(path, fields), timeout=120)
            assert straight.status_code == 500, (fields, straight.text)  # what the gateway must not pass on as a 502
            response = http.post(path, json=_body(path, fields))
            error = assert_openai_error(response, 400)["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (fields, error)
            assert error["message"].startswith(param.split(".")[0]) and "\n" not in error["message"], error
    for route in (CHAT, COMPLETIONS):
        # Some are refused by the gateway's own checks before the engine (and counted without a model label):
        # none may be counted as an engine failure.
        assert _count(gateway, route, "502") == before[(route, "502")]


def test_a_grammar_that_matches_no_text_is_refused_before_its_stream_starts(gateway: GatewayServer, tiny_engine: EngineProcess) -> None:
    """SGLang starts the stream (200), then sends its 500 as an event; the guard refuses such a grammar first (a 400
    before any event). The relay's own mapping of that event, for grammars the guard cannot judge: test_sse_scan."""
    body = {**_body(CHAT, {"ebnf": 'root ::= "x" a\na ::= a'}), "stream": True}  # the engine fails after the first token
    with httpx.stream("POST", tiny_engine.url + CHAT, json={**body, "model": "tiny"}, timeout=120) as straight:
        assert straight.status_code == 200
        assert "Grammar accept_token failed" in straight.read().decode()
    with httpx.stream("POST", gateway.url + CHAT, json=body, headers=auth(), timeout=120) as response:
        assert response.status_code == 400
        error = json.loads(response.read())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "ebnf" and "'a'" in error["message"], error


def test_validation_dump_with_brackets_in_its_location_is_rewritten(gateway: GatewayServer) -> None:
    """A client's dict key holding ")" and "]" ends up in the engine's dump: rewritten, not passed on raw."""
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2, "logit_bias": {"a)b]c": "x"}}
    response = httpx.post(gateway.url + CHAT, json=body, headers=auth(), timeout=120)
    message = assert_openai_error(response, 400)["error"]["message"]
    assert message.startswith("logit_bias.a)b]c: Input should be a valid number"), message
    assert "'input'" not in message and "{'type'" not in message, message


def test_score_errors_have_the_engines_shape(gateway: GatewayServer, tiny_engine: EngineProcess) -> None:
    """What SGLang's own test of /v1/score reads (status 400, body["type"], body["message"]) reads the same through
    the gateway; the gateway's OpenAI-shaped "error" is there as well."""
    bad = {"model": "tiny", "query": "The capital of France is", "items": ["Paris"], "label_token_ids": [999999], "apply_softmax": True}
    straight = httpx.post(tiny_engine.url + "/v1/score", json=bad, timeout=60)
    through = httpx.post(gateway.url + "/v1/score", json=bad, headers=auth(), timeout=60)
    assert straight.status_code == through.status_code == 400
    engine, ours = straight.json(), through.json()
    # object, type, code as the engine's (the gateway refuses the id itself, with its own message)
    assert {key: ours[key] for key in ("object", "type", "code")} == {key: engine[key] for key in ("object", "type", "code")}, (engine, ours)
    assert "999999" in ours["message"] and "vocabulary" in ours["message"]
    assert ours["error"]["type"] == "invalid_request_error" and ours["error"]["message"] == ours["message"]
    # The gateway's own refusals on that route have the same shape.
    refused = httpx.post(gateway.url + "/v1/score", json={**bad, "label_token_ids": "x"}, headers=auth(), timeout=60)
    assert refused.status_code == 400 and refused.json()["type"] == "BadRequestError" and refused.json()["object"] == "error"
    unknown = httpx.post(gateway.url + "/v1/score", json={**bad, "model": "nope"}, headers=auth(), timeout=60)
    assert unknown.status_code == 404 and unknown.json()["type"] == "NotFoundError" and unknown.json()["code"] == 404
