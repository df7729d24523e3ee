"""Tool calls on the real CPU engine, through the gateway, as the SDKs parse them: every route that takes tools x
every tool_choice x streamed or not, the refusal for an engine without a tool-call parser, and, on the real default
model (SmolLM2-135M-Instruct), forced calls and the tool result's round trip.

The matrix (3 routes x 4 choices x 2 = 24 cases) runs on the tiny random-weight model: a forced call (``required``, a
named function, Anthropic ``any``/``tool``) is held by the engine's grammar, not by the model's wit (the gateway marks
forced tools strict and offers a named tool alone: engine_guard.tool_calls), and a model that knows nothing of the
tools is the hardest test of that; it is also ten times faster than the real one (the suite's budget). It asserts the
exact objects the ``openai`` and ``anthropic`` SDKs build: chat ``tool_calls`` (ids, names, JSON arguments; streamed
deltas joined by index), Responses ``function_call`` items (streamed: ``output_item.added`` /
``function_call_arguments.done``), Messages ``tool_use`` blocks (streamed: ``input_json_delta``); a forced call names
an offered tool (the named one when named) with arguments that validate against its schema. Under ``auto`` and
``none`` no call comes back and none is smuggled into the text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from launch.process import EngineProcess
from tests.gateway_server import GatewayServer, serve, serve_engine

CITY = {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}  # bounded: random weights would write a string forever
WEATHER = {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": CITY, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]},
}  # fmt: skip
TIME = {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
}  # fmt: skip
SCHEMAS = {tool["name"]: tool["parameters"] for tool in (WEATHER, TIME)}
QUESTION = "What's the weather like in Paris today?"
CHOICES = ("auto", "required", "named", "none")


@pytest.fixture(scope="module")
def gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    with serve_engine("tiny", tiny_engine) as server:
        yield server


@pytest.fixture(scope="module")
def real_gateway(smollm2_engine: EngineProcess) -> Iterator[GatewayServer]:
    with serve_engine("smollm2", smollm2_engine) as server:
        yield server


def _clients(gateway: GatewayServer) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300),
            anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=300))  # fmt: skip


def _sampling(choice: str, real: bool) -> dict[str, Any]:
    """Greedy on the real model. The tiny one samples: greedy, its random weights fill a call's JSON with whitespace (which
    the grammar allows inside a tool call) until max_tokens; sampled, a call ends in tens of tokens (ample room given)."""
    forced = choice in ("required", "named")
    return {"temperature": 0, "max_tokens": 40 if forced else 12} if real else {"temperature": 1.0, "max_tokens": 300 if forced else 12}


def chat_calls(client: openai.OpenAI, choice: str, stream: bool, real: bool) -> tuple[str, list[dict[str, Any]]]:
    """(text, calls) of a chat completion: calls as {id, name, arguments} from the SDK's own objects."""
    tool_choice: Any = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else choice
    kwargs = dict(model="default", messages=[{"role": "user", "content": QUESTION}], **_sampling(choice, real),
                  tools=[{"type": "function", "function": tool} for tool in (WEATHER, TIME)], tool_choice=tool_choice)
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
        return message.content or "", calls
    text, by_index = "", {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for part in delta.tool_calls or []:
            call = by_index.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            if part.id:
                assert call["id"] is None, "a call's id comes once, in its first delta"
                call["id"] = part.id
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
    return text, [by_index[index] for index in sorted(by_index)]


def responses_calls(client: openai.OpenAI, choice: str, stream: bool, real: bool) -> tuple[str, list[dict[str, Any]]]:
    tool_choice: Any = {"type": "function", "name": "get_time"} if choice == "named" else choice
    sampling = _sampling(choice, real)
    kwargs = dict(model="default", input=QUESTION, temperature=sampling["temperature"], max_output_tokens=sampling["max_tokens"], store=False,
                  tools=[{"type": "function", **tool} for tool in (WEATHER, TIME)], tool_choice=tool_choice)
    if not stream:
        response = client.responses.create(**kwargs)
    else:
        added, done, response = [], [], None
        for event in client.responses.create(**kwargs, stream=True):
            if event.type == "response.output_item.added" and event.item.type == "function_call":
                added.append(event.item.call_id)
            elif event.type == "response.function_call_arguments.done":
                done.append(event.arguments)
            elif event.type == "response.completed" or event.type == "response.incomplete":
                response = event.response
        assert response is not None
        final = [item for item in response.output if item.type == "function_call"]
        assert added == [item.call_id for item in final] and done == [item.arguments for item in final]
    calls = [{"id": item.call_id, "name": item.name, "arguments": item.arguments} for item in response.output if item.type == "function_call"]
    return response.output_text, calls


def messages_calls(client: anthropic.Anthropic, choice: str, stream: bool, real: bool) -> tuple[str, list[dict[str, Any]]]:
    tool_choice = {"named": {"type": "tool", "name": "get_time"}, "required": {"type": "any"}}.get(choice, {"type": choice})
    sampling = _sampling(choice, real)
    kwargs = dict(model="default", messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": sampling["temperature"]},
                  max_tokens=sampling["max_tokens"],
                  tools=[{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in (WEATHER, TIME)],
                  tool_choice=tool_choice)
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    text = "".join(block.text for block in message.content if block.type == "text")
    calls = [{"id": b.id, "name": b.name, "arguments": json.dumps(b.input)} for b in message.content if b.type == "tool_use"]
    if calls and choice in ("required", "named"):  # the engine ends a forced turn at its calls (the engine plugin)
        assert message.stop_reason == "tool_use", message.stop_reason
    return text, calls


ROUTES = {"chat": chat_calls, "responses": responses_calls, "messages": messages_calls}


def _check_forced(choice: str, text: str, calls: list[dict[str, Any]]) -> None:
    assert calls, f"a forced call came back as no call (text {text!r})"
    ids = [call["id"] for call in calls]
    assert all(ids) and len(set(ids)) == len(ids), ids
    for call in calls:
        assert call["name"] == "get_time" if choice == "named" else call["name"] in SCHEMAS, call
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_tool_choice_gives_the_calls_the_sdk_parses(route: str, choice: str, stream: bool, gateway: GatewayServer) -> None:
    openai_client, anthropic_client = _clients(gateway)
    text, calls = ROUTES[route](anthropic_client if route == "messages" else openai_client, choice, stream, False)
    if choice in ("auto", "none"):
        assert calls == [], (text, calls)
        assert "<tool_call>" not in text  # a call is never left as text: the engine's parser takes it out
        return
    _check_forced(choice, text, calls)


@pytest.mark.real_model
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_the_default_model_makes_the_named_call_in_each_dialect(route: str, real_gateway: GatewayServer) -> None:
    """The real default model, streamed: the named function, with the city the user asked about."""
    openai_client, anthropic_client = _clients(real_gateway)
    text, calls = ROUTES[route](anthropic_client if route == "messages" else openai_client, "named", True, True)
    _check_forced("named", text, calls)
    assert json.loads(calls[0]["arguments"])["city"] == "Paris"


ALONE = {"named": {"type": "function", "function": {"name": "get_time"}}, "required_one": "required"}


def _alone(choice: str) -> dict[str, Any]:
    """A forced chat call that must come alone: named, or required with parallel_tool_calls false."""
    return {"tools": [{"type": "function", "function": tool} for tool in (WEATHER, TIME)], "tool_choice": ALONE[choice],
            **({"parallel_tool_calls": False} if choice == "required_one" else {})}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("choice", sorted(ALONE))
def test_a_forced_chat_call_that_comes_alone_ends_right_after_it(choice: str, stream: bool, gateway: GatewayServer) -> None:
    """The engine stops on the call's end marker (engine_guard.tool_calls.end_forced_call): finish_reason tool_calls,
    well under max_tokens. ``ignore_eos``: the model cannot end it by chance, only the marker can (before: "length",
    all 300 tokens, the model writing on after its call)."""
    openai_client, _ = _clients(gateway)
    kwargs = dict(model="default", messages=[{"role": "user", "content": QUESTION}], temperature=1.0, max_tokens=300,
                  extra_body={"ignore_eos": True}, **_alone(choice))  # fmt: skip
    if not stream:
        answer = openai_client.chat.completions.create(**kwargs)
        (choice_,) = answer.choices
        finish, tokens, text = choice_.finish_reason, answer.usage.completion_tokens, choice_.message.content or ""
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in choice_.message.tool_calls or []]
    else:
        finish, tokens, text, by_index = None, None, "", {}
        for chunk in openai_client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
            for part in chunk.choices:
                finish = part.finish_reason or finish
                text += part.delta.content or ""
                for delta in part.delta.tool_calls or []:
                    call = by_index.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                    if delta.function is not None:
                        call["name"] += delta.function.name or ""
                        call["arguments"] += delta.function.arguments or ""
        calls = [by_index[index] for index in sorted(by_index)]
    assert finish == "tool_calls" and tokens is not None and tokens < 300, (finish, tokens)
    assert len(calls) == 1 and "tool_call>" not in text, (calls, text)  # the kept marker is the parser's, never text
    _check_forced("named" if choice == "named" else "required", text, calls)


def test_the_callers_stop_strings_still_end_a_forced_call(gateway: GatewayServer) -> None:
    """The end marker is added to the caller's stop strings, not in their place: a stop the call's text reaches ends
    the answer there, and a call cut short is no call (before, the engine answered "tool_calls" from the cut text)."""
    openai_client, _ = _clients(gateway)
    answer = openai_client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}], temperature=1.0, max_tokens=300, stop=["arguments"],
        extra_body={"ignore_eos": True}, **_alone("named"),
    )  # fmt: skip
    (choice,) = answer.choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice  # cut inside the call: no call
    assert answer.usage.completion_tokens < 300


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_default_model_ends_its_named_chat_call_after_it(stream: bool, real_gateway: GatewayServer) -> None:
    """Greedy, the real model's named call ends at its marker: tool_calls, not "length" after 80 tokens (before)."""
    openai_client, _ = _clients(real_gateway)
    kwargs = dict(model="default", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=80, **_alone("named"))
    if not stream:
        answer = openai_client.chat.completions.create(**kwargs)
        finish, tokens, (call,) = answer.choices[0].finish_reason, answer.usage.completion_tokens, answer.choices[0].message.tool_calls
        arguments = call.function.arguments
    else:
        finish, tokens, arguments = None, None, ""
        for chunk in openai_client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
            for part in chunk.choices:
                finish = part.finish_reason or finish
                arguments += "".join(d.function.arguments or "" for d in part.delta.tool_calls or [] if d.function)
    assert finish == "tool_calls" and tokens is not None and tokens < 80, (finish, tokens)
    assert json.loads(arguments)["city"] == "Paris"


def test_tools_for_an_engine_without_a_tool_parser_are_refused_naming_the_setting(tiny_engine: EngineProcess) -> None:
    """An engine with no --tool-call-parser would answer a forced call as text: 400 in each route's dialect."""
    from launch.config import load_config
    from tests.conftest import TINY_CONFIG

    assert load_config(TINY_CONFIG).engine("tiny").tool_call_parser, "the tiny engine runs a parser: this test starts none"
    bare = {"parameters": TIME["parameters"], "name": TIME["name"]}
    with serve({"plain": {"url": tiny_engine.url}}) as server:
        state = server.state
        (backend,) = state.registry.route("plain").replicas
        backend.learn_tool_parser(None)  # as /get_server_info says of such an engine
        cases = {
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": bare}], "tool_choice": "required"},
            "/v1/responses": {"input": "hi", "tools": [{"type": "function", **bare}]},
            "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "tools": [{"name": "get_time", "input_schema": TIME["parameters"]}]},
        }
        for path, body in cases.items():
            answer = httpx.post(server.url + path, json={"model": "plain", **body}, timeout=60)
            assert answer.status_code == 400, (path, answer.text)
            error = answer.json()["error"]
            assert "tool_call_parser" in error["message"] and "'plain'" in error["message"], error
            if path == "/v1/messages":
                assert answer.json()["type"] == "error" and error["type"] == "invalid_request_error"
            else:
                assert error["code"] == "tools_unsupported" and error["param"] == "tools"
        off = dict(cases["/v1/chat/completions"], tool_choice="none", max_tokens=4)
        assert httpx.post(server.url + "/v1/chat/completions", json={"model": "plain", **off}, timeout=60).status_code == 200


def test_an_engine_tells_the_gateway_its_tool_parser(gateway: GatewayServer) -> None:
    """A url model's parser comes from the engine's /get_server_info: the check is made from what the engine says."""
    (backend,) = gateway.state.registry.route("tiny").replicas
    assert backend.knows_tool_parser and backend.tool_call_parser in ("qwen25", "qwen")  # SGLang says qwen25 as qwen


@pytest.mark.real_model
def test_a_tool_result_reaches_the_model_in_each_dialect(real_gateway: GatewayServer) -> None:
    """Call -> tool result -> answer, on the real default model: the result the client sends back is what it answers from."""
    openai_client, anthropic_client = _clients(real_gateway)
    tools = [{"type": "function", "function": WEATHER}]
    first = openai_client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}], tools=tools, tool_choice="required",
        temperature=0, max_tokens=40,
    ).choices[0].message
    (call,) = first.tool_calls
    result = "Heavy snow, minus 12 degrees."
    turn = [{"role": "user", "content": QUESTION}, first.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = openai_client.chat.completions.create(model="default", messages=turn, tools=tools, temperature=0, max_tokens=24)
    assert "snow" in (answer.choices[0].message.content or "").lower(), answer.choices[0].message

    responses = openai_client.responses.create(
        model="default", temperature=0, max_output_tokens=26, store=False, tools=[{"type": "function", **WEATHER}],
        input=[{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": call.id, "name": call.function.name, "arguments": call.function.arguments},
               {"type": "function_call_output", "call_id": call.id, "output": result}],
    )
    assert "snow" in responses.output_text.lower(), responses.output

    message = anthropic_client.messages.create(
        model="default", extra_body={"temperature": 0}, max_tokens=24,
        tools=[{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}],
        messages=[{"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.function.name,
                                                     "input": json.loads(call.function.arguments)}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}],
    )
    assert "snow" in "".join(block.text for block in message.content if block.type == "text").lower(), message.content


def _responses_named_call(client: openai.OpenAI, stream: bool) -> Any:
    """What openai-agents sends for a named function tool at ``max_output_tokens: 60`` (its final Response)."""
    kwargs = dict(model="default", input=QUESTION, temperature=0, max_output_tokens=60, store=False,
                  tools=[{"type": "function", "strict": True, **tool} for tool in (WEATHER, TIME)],
                  tool_choice={"type": "function", "name": "get_time"})  # fmt: skip
    if not stream:
        return client.responses.create(**kwargs)
    final = [event.response for event in client.responses.create(**kwargs, stream=True)
             if event.type in ("response.completed", "response.incomplete")]  # fmt: skip
    assert len(final) == 1, final
    return final[0]


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_default_models_named_responses_call_is_complete_within_60_tokens(stream: bool, real_gateway: GatewayServer) -> None:
    """openai-agents' check: a Response that is not ``completed`` is a ModelBehaviorError, even with its call whole. The
    engine ends the answer at the call (before: the model wrote on after it, ``incomplete`` at 60 tokens)."""
    openai_client, _ = _clients(real_gateway)
    response = _responses_named_call(openai_client, stream)
    assert response.status == "completed" and response.incomplete_details is None, (response.status, response.usage)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["city"] == "Paris", call
    assert response.usage.output_tokens < 60, response.usage
    print("named Responses call:", response.status, response.usage.output_tokens, "output tokens of 60")


def _messages_tool_call(client: anthropic.Anthropic, stream: bool, max_tokens: int) -> Any:
    """What instructor's ANTHROPIC_TOOLS mode sends: the named tool forced, one call (its final Message)."""
    kwargs = dict(model="default", messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens, extra_body={"temperature": 0},
                  tools=[{"name": TIME["name"], "description": TIME["description"], "input_schema": TIME["parameters"]}],
                  tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True})  # fmt: skip
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as events:
        return events.get_final_message()


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_default_models_forced_tool_use_ends_as_tool_use(stream: bool, real_gateway: GatewayServer) -> None:
    """instructor's check: ``stop_reason: "max_tokens"`` is an IncompleteOutputException, even with the tool_use block
    whole. The engine ends the answer at the call (before: it ran on to max_tokens)."""
    _, anthropic_client = _clients(real_gateway)
    message = _messages_tool_call(anthropic_client, stream, max_tokens=60)
    assert message.stop_reason == "tool_use", (message.stop_reason, message.usage)
    (block,) = [block for block in message.content if block.type == "tool_use"]
    assert block.name == "get_time" and block.input["city"] == "Paris", block
    assert message.usage.output_tokens < 60, message.usage
    print("forced Messages tool_use:", message.stop_reason, message.usage.output_tokens, "output tokens of 60")


TWO_CITIES = "What time is it in Tokyo and what is the weather in Lima?"


def _parallel_forced(route: str, gateway: GatewayServer, stream: bool) -> tuple[str, list[str], int]:
    """A forced choice that allows parallel calls (chat and Responses ``required``, Messages ``any``) at a limit of 60
    tokens, greedy: (how it ended, the calls' names, output tokens), as each SDK reports them."""
    openai_client, anthropic_client = _clients(gateway)
    tools = [WEATHER, TIME]
    if route == "chat":
        kwargs: dict[str, Any] = dict(model="default", messages=[{"role": "user", "content": TWO_CITIES}], temperature=0, max_tokens=60,
                                      tools=[{"type": "function", "function": t} for t in tools], tool_choice="required")  # fmt: skip
        if not stream:
            answer = openai_client.chat.completions.create(**kwargs)
            return (
                answer.choices[0].finish_reason,
                [c.function.name for c in answer.choices[0].message.tool_calls or []],
                answer.usage.completion_tokens,
            )
        finish, names, tokens = "", [], 0
        for chunk in openai_client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        ):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                names += [
                    part.function.name for part in choice.delta.tool_calls or [] if part.function and part.function.name
                ]
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return finish, names, tokens
    if route == "responses":
        kwargs = dict(model="default", input=TWO_CITIES, temperature=0, max_output_tokens=60, store=False,
                      tools=[{"type": "function", **t} for t in tools], tool_choice="required")  # fmt: skip
        if stream:
            (response,) = [
                e.response
                for e in openai_client.responses.create(**kwargs, stream=True)
                if e.type in ("response.completed", "response.incomplete")
            ]
        else:
            response = openai_client.responses.create(**kwargs)
        return (
            response.status,
            [item.name for item in response.output if item.type == "function_call"],
            response.usage.output_tokens,
        )
    kwargs = dict(model="default", messages=[{"role": "user", "content": TWO_CITIES}], max_tokens=60, extra_body={"temperature": 0},
                  tools=[{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in tools],
                  tool_choice={"type": "any"})  # fmt: skip
    if stream:
        with anthropic_client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = anthropic_client.messages.create(**kwargs)
    return (
        message.stop_reason or "",
        [b.name for b in message.content if b.type == "tool_use"],
        message.usage.output_tokens,
    )


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_the_default_models_forced_parallel_calls_end_at_the_calls(
    route: str, stream: bool, real_gateway: GatewayServer
) -> None:
    """A forced choice that allows several calls ends where text that is no call begins (the engine plugin's scheduler
    hook): before, the model wrote on after its call (text the parser drops) and the answer came back cut short at 60
    tokens (``length``, ``incomplete``, ``max_tokens``) with its call whole."""
    finish, names, tokens = _parallel_forced(route, real_gateway, stream)
    assert finish == {"chat": "tool_calls", "responses": "completed", "messages": "tool_use"}[route], (
        finish,
        names,
        tokens,
    )
    assert names and set(names) <= set(SCHEMAS) and tokens < 60, (names, tokens)
    print(f"forced parallel calls on {route}: {finish}, {names}, {tokens} output tokens of 60")
