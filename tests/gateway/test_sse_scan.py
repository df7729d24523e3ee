"""The SSE event scanner of gateway.data.relay (pure: no socket, no engine).

The relay cuts upstream body pieces at event boundaries and scans them for the few events worth parsing
(a usage object, an engine error, a Responses API ``response.created``): those are read (usage, the new
response's id) or rewritten (an engine error, sanitized); every other byte goes to the client as it came.
The scanner is driven here the way the relay drives it: :meth:`SSEProxyResponse._complete_events` per piece,
:meth:`SSEProxyResponse._last_partial_event` for what is left when the upstream body ends.
"""

from __future__ import annotations

import orjson
import pytest

from gateway.core.context import RequestInfo
from gateway.core.errors import StreamKind
from gateway.core.limits import ConcurrencyLimiter
from gateway.data.answer import _parsed_if
from gateway.data.lease import Lease
from gateway.data.relay import _MAX_PENDING, SSEProxyResponse, _usage_of
from gateway.data.stream_pool import StreamExchange

CHUNK = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'
USAGE = b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}\n\n'
DONE = b"data: [DONE]\n\n"
SECRET_PATH = "/srv/engine/python/sglang/srt/managers/scheduler.py"


def _relay(kind: StreamKind = StreamKind.DATA, **kwargs: object) -> SSEProxyResponse:
    from gateway.config import LimitSettings

    lease = Lease(ConcurrencyLimiter(LimitSettings()))
    lease.upstream = StreamExchange.__new__(StreamExchange)  # never read from: the scanner works on the bytes given
    info = RequestInfo("req-1", "POST", "/v1/chat/completions")
    return SSEProxyResponse(lease, info, metrics=None, model="tiny", kind=kind, **kwargs)  # type: ignore[arg-type]


def _data(event: dict) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _events(out: bytes) -> list[dict]:
    return [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]


def test_events_without_markers_pass_unchanged() -> None:
    relay = _relay()
    events = CHUNK * 3 + b": keep-alive comment\n\n" + b"event: ping\ndata: {}\n\n"
    out = relay._complete_events(events)
    assert out == events
    assert relay.info.prompt_tokens is None and relay.info.error is None


def test_usage_is_read_and_the_event_passes_as_it_came() -> None:
    relay = _relay()
    out = relay._complete_events(CHUNK + USAGE + DONE)
    assert out == CHUNK + USAGE + DONE
    assert relay.info.prompt_tokens == 3 and relay.info.completion_tokens == 5


def test_usage_written_with_a_space_is_read_too() -> None:
    relay = _relay()
    event = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}}\n\n'
    assert relay._complete_events(event) == event
    assert relay.info.prompt_tokens == 7 and relay.info.completion_tokens == 1


def test_every_marked_event_of_a_piece_is_read_and_the_bytes_between_kept() -> None:
    relay = _relay()
    first = _data({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    last = _data({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 9}})
    events = CHUNK + first + CHUNK + b"event: x\n" + last + CHUNK
    assert relay._complete_events(events) == events
    assert relay.info.completion_tokens == 9


def test_a_marker_outside_a_data_line_is_left_alone() -> None:
    relay = _relay()
    events = b': a comment mentioning "usage":{"prompt_tokens":4}\n\n' + b'data: {"usage":{"prompt_tokens":' + b"\n\n"
    assert relay._complete_events(events) == events  # a comment, and a data line that is not JSON
    assert relay.info.prompt_tokens is None


def test_a_marked_data_line_that_is_not_an_object_is_left_alone() -> None:
    relay = _relay()
    events = b'data: {"error": broken json\n\n'
    assert relay._complete_events(events) == events
    assert relay.info.error is None


def test_pieces_are_cut_at_event_boundaries() -> None:
    relay = _relay()
    whole = CHUNK + USAGE
    cut = len(CHUNK) + 20  # inside the usage event
    assert relay._complete_events(whole[:cut]) == CHUNK
    assert relay.info.prompt_tokens is None  # the usage event is not complete yet
    assert relay._complete_events(whole[cut:]) == USAGE
    assert relay.info.prompt_tokens == 3
    assert relay._complete_events(b"data: {") == b""  # nothing complete: held back
    assert relay._complete_events(b'"x":1}\n') == b""
    assert relay._complete_events(b"\n") == b'data: {"x":1}\n\n'
    assert relay._pending == b""


def test_an_event_split_right_after_its_data_line_waits_for_its_blank_line() -> None:
    relay = _relay()
    assert relay._complete_events(USAGE[:-1]) == b""
    assert relay._complete_events(USAGE[-1:] + CHUNK[:5]) == USAGE
    assert relay.info.prompt_tokens == 3
    assert relay._complete_events(CHUNK[5:]) == CHUNK


def test_an_oversized_event_is_forwarded_unsplit_and_unscanned() -> None:
    relay = _relay()
    big = b'data: {"choices":[],"usage":{"prompt_tokens":1},"pad":"' + b"x" * _MAX_PENDING
    out = relay._complete_events(big)
    assert out == big and relay._pending == b"" and relay.info.prompt_tokens is None
    exactly = b"y" * _MAX_PENDING  # up to the limit it is still held back
    assert relay._complete_events(exactly) == b"" and relay._pending == exactly


def test_an_engine_error_event_is_sanitized_and_reframed() -> None:
    relay = _relay(request={"messages": []})
    message = f"invalid request at {SECRET_PATH}"
    out = relay._complete_events(CHUNK + _data({"error": {"message": message, "code": 400, "type": "BadRequest"}}))
    assert out.startswith(CHUNK) and out.endswith(b"\n\n")
    (_, error_event) = _events(out)
    error = error_event["error"]
    assert SECRET_PATH not in out.decode() and "invalid request at" in error["message"]
    assert relay.info.error is not None and SECRET_PATH not in relay.info.error and "invalid request" in relay.info.error


def test_an_engine_error_without_a_numeric_code_counts_as_a_failure_of_the_engine() -> None:
    relay = _relay()
    out = relay._complete_events(_data({"error": {"message": "CUDA out of memory", "code": "oom"}}))
    (event,) = _events(out)
    assert event["error"]["code"] == "upstream_error"  # a 5xx: the engine's own words stay in the log
    assert "CUDA" not in event["error"]["message"] and "500" in event["error"]["message"]
    assert relay.info.error is not None and "CUDA out of memory" in relay.info.error


def test_an_engine_error_given_as_a_string() -> None:
    relay = _relay()
    (event,) = _events(relay._complete_events(_data({"error": f"bad {SECRET_PATH}", "code": 400})))
    assert event["error"]["code"] == "upstream_error"  # a string error: no status of its own, a 500
    assert relay.info.error is not None and SECRET_PATH not in relay.info.error and "bad" in relay.info.error


def test_an_error_field_in_a_chunk_with_choices_or_null_is_no_error() -> None:
    relay = _relay()
    with_choices = _data({"choices": [{"delta": {}}], "error": {"message": "x"}})
    null = _data({"choices": [], "error": None})
    assert relay._complete_events(with_choices + null) == with_choices + null
    assert relay.info.error is None


@pytest.mark.parametrize("kind", [StreamKind.RESPONSES, StreamKind.ANTHROPIC])
def test_other_framings_do_not_reframe_chat_errors(kind: StreamKind) -> None:
    relay = _relay(kind)
    # a chat-style error object in a Responses / Anthropic stream is rewritten in place, never as a chat event
    out = relay._complete_events(b"event: error\n" + _data({"type": "error", "message": f"at {SECRET_PATH}"}))
    assert out.startswith(b"event: error\ndata: {") and SECRET_PATH not in out.decode()
    assert _events(out)[0]["type"] == "error"


def test_responses_the_created_response_id_is_told() -> None:
    created: list[str] = []
    relay = _relay(StreamKind.RESPONSES, on_created=created.append)
    event = b"event: response.created\n" + _data({"type": "response.created", "response": {"id": "resp_1", "error": None}})
    assert relay._complete_events(event) == event
    assert created == ["resp_1"]
    odd = _data({"type": "response.created", "response": {"id": 5}}) + _data({"type": "response.created", "response": {}})
    assert relay._complete_events(odd) == odd
    assert created == ["resp_1"]
    other = _data({"type": "response.in_progress", "response": {"id": "resp_2"}, "x": '"response.created"'})
    relay._complete_events(other)
    assert created == ["resp_1"]  # only the creation event names a new response


def test_responses_a_response_that_is_not_an_object_passes() -> None:
    created: list[str] = []
    relay = _relay(StreamKind.RESPONSES, on_created=created.append)
    event = _data({"type": "response.created", "response": "not an object"})
    assert relay._complete_events(event) == event
    assert created == []


def test_responses_without_a_listener_pass_creation_events() -> None:
    relay = _relay(StreamKind.RESPONSES)
    event = _data({"type": "response.created", "response": {"id": "resp_1"}})
    assert relay._complete_events(event) == event


def test_responses_usage_inside_the_response_object() -> None:
    relay = _relay(StreamKind.RESPONSES)
    event = _data({"type": "response.completed", "response": {"id": "r", "usage": {"input_tokens": 11, "output_tokens": 4}}})
    assert relay._complete_events(event) == event
    assert relay.info.prompt_tokens == 11 and relay.info.completion_tokens == 4


def test_responses_null_errors_are_not_parsed_and_real_ones_sanitized() -> None:
    relay = _relay(StreamKind.RESPONSES)
    delta = b"event: response.output_text.delta\n" + _data({"type": "response.output_text.delta", "delta": "hi", "error": None})
    assert relay._complete_events(delta) == delta
    failed = _data({"type": "response.failed", "response": {"id": "r", "error": {"code": "server_error", "message": f"boom in {SECRET_PATH}"}}})
    out = relay._complete_events(failed)
    (event,) = _events(out)
    assert event["response"]["error"]["code"] == "server_error"
    assert SECRET_PATH not in event["response"]["error"]["message"] and "boom in" in event["response"]["error"]["message"]
    assert relay.info.error == event["response"]["error"]["message"]


def test_responses_error_event_and_the_first_error_is_kept_for_the_log() -> None:
    relay = _relay(StreamKind.RESPONSES)
    first = _data({"type": "error", "code": "x", "message": "first failure"})
    second = _data({"type": "error", "code": "x", "message": "second failure"})
    out = relay._complete_events(first + second)
    assert [event["message"] for event in _events(out)] == ["first failure", "second failure"]
    assert relay.info.error == "first failure"


def test_the_logged_error_is_bounded() -> None:
    relay = _relay(StreamKind.RESPONSES)
    relay._complete_events(_data({"type": "error", "message": "word " * 200}))
    assert relay.info.error is not None and len(relay.info.error) == 300


def test_anthropic_usage_of_message_start_and_error_events() -> None:
    relay = _relay(StreamKind.ANTHROPIC)
    start = b"event: message_start\n" + _data({"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 6, "output_tokens": 1}}})
    delta = b"event: message_delta\n" + _data({"type": "message_delta", "usage": {"output_tokens": 12}})
    assert relay._complete_events(start + delta) == start + delta
    assert relay.info.prompt_tokens == 6 and relay.info.completion_tokens == 12
    error = b"event: error\n" + _data({"type": "error", "error": {"type": "api_error", "message": f"failed at {SECRET_PATH}"}})
    out = relay._complete_events(error)
    (event,) = _events(out)
    assert event["error"]["type"] == "api_error" and SECRET_PATH not in event["error"]["message"]
    assert "failed at" in event["error"]["message"] and relay.info.error == event["error"]["message"]


def test_anthropic_an_error_typed_event_without_a_message_is_left_alone() -> None:
    relay = _relay(StreamKind.ANTHROPIC)
    event = _data({"type": "error", "detail": f"{SECRET_PATH}"})
    assert relay._complete_events(event) == event
    assert relay.info.error is None


def test_the_last_partial_event_when_the_body_ended() -> None:
    relay = _relay()
    # the stream's own ending without its closing blank line: as it is
    assert relay._last_partial_event(b"data: [DONE]") == b"data: [DONE]"
    # an event whose blank line never came: its whole lines, closed with one blank line; a cut line dropped
    assert relay._last_partial_event(b'data: {"a":1}\ndata: {"b":') == b'data: {"a":1}\n\n'
    assert relay._last_partial_event(b'data: {"a":1}\n') == b'data: {"a":1}\n\n'
    assert relay._last_partial_event(b'data: {"cut') == b""
    assert relay._last_partial_event(b"\n") == b""


def test_the_last_partial_event_is_scanned() -> None:
    relay = _relay()
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}'
    assert relay._last_partial_event(usage + b"\n" + b"data: [DO") == usage + b"\n\n"
    assert relay.info.completion_tokens == 3
    relay = _relay()
    error = _data({"error": {"message": f"late {SECRET_PATH}", "code": 400}}).rstrip(b"\n")
    out = relay._last_partial_event(error + b"\ndata: [DONE]")
    assert SECRET_PATH not in out.decode() and out.endswith(b"data: [DONE]")
    assert relay.info.error is not None


def test_usage_of_an_event() -> None:
    assert _usage_of({"usage": {"prompt_tokens": 1}}) == {"prompt_tokens": 1}
    assert _usage_of({"usage": None, "response": {"usage": {"input_tokens": 2}}}) == {"input_tokens": 2}
    assert _usage_of({"message": {"usage": {"input_tokens": 3}}}) == {"input_tokens": 3}
    assert _usage_of({"response": {"usage": None}, "message": {"usage": {"input_tokens": 4}}}) == {"input_tokens": 4}
    assert _usage_of({"response": "text", "message": {"usage": 5}}) is None
    assert _usage_of({"usage": {"a": 1}, "response": {"usage": {"b": 2}}}) == {"a": 1}  # the top level first
    assert _usage_of({}) is None


def test_parsed_if() -> None:
    assert _parsed_if(b'{"usage": {"prompt_tokens": 1}}', b'"usage"') == {"usage": {"prompt_tokens": 1}}
    assert _parsed_if(b'{"id": 1}', b'"usage"') is None  # not mentioned: not parsed
    assert _parsed_if(b'{"usage": broken', b'"usage"') is None
    assert _parsed_if(b'["usage"]', b'"usage"') is None


def test_an_engine_error_mid_stream_blamed_on_the_request_is_the_clients_400() -> None:
    # an engine 500 whose message is about the request's own input (here: its grammar) is the client's mistake
    relay = _relay(request={"regex": "(", "prompt": "x"})
    out = relay._complete_events(_data({"error": {"message": "Grammar accept_token failed", "code": 500}}))
    (event,) = _events(out)
    assert event["error"]["code"] == "invalid_request" and event["error"]["param"] == "regex"
    assert event["error"]["message"].startswith("regex: the grammar accepts no token")
    without_grammar = _relay(request={"prompt": "x"})
    (event,) = _events(without_grammar._complete_events(_data({"error": {"message": "Grammar accept_token failed", "code": 500}})))
    assert event["error"]["code"] == "upstream_error"


def test_a_client_error_event_keeps_the_engines_message_sanitized() -> None:
    relay = _relay()
    out = relay._complete_events(CHUNK + _data({"error": {"message": f"prompt too long ({SECRET_PATH})", "code": 400}}) + CHUNK)
    assert out.startswith(CHUNK) and out.endswith(b"}\n\n" + CHUNK) and b"}\n\n\n" not in out  # framed as one event
    (_, event, _) = _events(out)
    assert event["error"]["message"] == "prompt too long (<path>)"
    silent = _relay()
    (event,) = _events(silent._complete_events(_data({"error": {"code": 400}})))
    assert event["error"]["message"] == "upstream error"  # no message: a fixed one, never the engine's raw body


def test_a_piece_that_starts_with_a_blank_line() -> None:
    relay = _relay()
    assert relay._complete_events(b"\n\n" + USAGE[:10]) == b"\n\n"
    assert relay._complete_events(USAGE[10:]) == USAGE
    leading = _relay()
    assert leading._complete_events(b"\n" + USAGE) == b"\n" + USAGE
    assert leading.info.prompt_tokens == 3  # the event after a stray newline is still read


def test_only_data_lines_are_parsed() -> None:
    relay = _relay()
    # "event:" is as long as "data: ": what follows it would parse, but it is not an event's data
    events = b'event:{"usage":{"prompt_tokens":4,"completion_tokens":1}}\ndata: {}\n\n'
    assert relay._complete_events(events) == events
    assert relay.info.prompt_tokens is None


def test_the_last_partial_event_keeps_every_whole_line() -> None:
    relay = _relay()
    assert relay._last_partial_event(b'data: {"a":1}\ndata: {"b":2}\ndata: {"c') == b'data: {"a":1}\ndata: {"b":2}\n\n'


def test_an_error_that_ends_the_body_without_a_newline_is_sanitized() -> None:
    relay = _relay()
    last = _data({"error": {"message": f"failed at {SECRET_PATH}", "code": 400}}).rstrip(b"\n")
    out = relay._last_partial_event(last)  # the stream's own last event ('data: {"error":' ends a chat stream)
    assert SECRET_PATH not in out.decode() and _events(out)[0]["error"]["message"] == "failed at <path>"


@pytest.mark.parametrize(
    ("kind", "finishing", "ordinary"),
    [
        (
            StreamKind.DATA,
            b'data: {"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}\n\n',
            [CHUNK, b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'],
        ),
        (
            StreamKind.RESPONSES,
            b'event: response.output_item.done\ndata: {"type":"response.output_item.done","item":{}}\n\n',
            [b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'],
        ),
        (
            StreamKind.ANTHROPIC,
            b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"}}\n\n',
            [
                b'event: message_start\ndata: {"type":"message_start","message":{"stop_reason":null}}\n\n',
                b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"hi"}}\n\n',
            ],
        ),
    ],
)
def test_what_says_a_stream_is_finishing_is_found_in_each_dialect(kind: StreamKind, finishing: bytes, ordinary: list[bytes]) -> None:
    """A read carrying a stream's finish is not followed by a coalescing rest (its end comes at once): the relay
    says so for that read, and for no other; either way the read is relayed as it came."""
    relay, written = _writing_relay(kind)
    reads = [*ordinary, ordinary[0] + finishing, ordinary[-1]]
    for read in reads:
        relay._on_data(read)
    assert [relay._says_finishing(read) for read in reads] == [False] * len(ordinary) + [True, False]
    assert written == reads


@pytest.mark.parametrize("usage_first", [False, True])
def test_a_finish_and_a_usage_object_in_one_event_are_both_seen(usage_first: bool) -> None:
    """Whichever comes first in the event: the usage is read and the read says the stream is finishing."""
    relay, written = _writing_relay(StreamKind.DATA)
    fields = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    event = _data(dict(reversed(fields.items())) if usage_first else fields)
    relay._on_data(event)
    assert relay._says_finishing(event)
    assert relay.info.prompt_tokens == 3 and relay.info.completion_tokens == 5 and written == [event]


@pytest.mark.parametrize("kind", list(StreamKind))
def test_the_stream_end_is_finishing(kind: StreamKind) -> None:
    relay, written = _writing_relay(kind)
    relay._on_data(CHUNK)
    relay._on_data(DONE)
    assert not relay._says_finishing(CHUNK) and relay._says_finishing(DONE)
    assert written == [CHUNK, DONE]  # [DONE] goes out as it comes, not held for the body's close


@pytest.mark.parametrize("space", ["", " "])
def test_a_failed_responses_stream_numbers_its_error_event_after_the_engines_last(space: str) -> None:
    """The error event that ends a failed Responses stream takes the number after the last event's (the engine
    counts from 0), read from the last events relayed; 0 when the engine numbered none."""
    relay, _ = _writing_relay(StreamKind.RESPONSES)
    assert relay._next_sequence_number() == 0
    for number in range(7):
        relay._on_data(b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":%s%d}\n\n' % (space.encode(), number))
    assert relay._next_sequence_number() == 7


def test_a_failed_responses_stream_numbers_its_error_event_after_a_piece_that_ended_with_done() -> None:
    """The piece that ended with [DONE] is kept apart from the last two, and a partial last event goes out as the
    stream's tail: either may hold the highest number sent, and the error event's follows it (it had repeated one)."""
    relay, _ = _writing_relay(StreamKind.RESPONSES)
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":%d}\n\n'
    relay._on_data(delta % 0 + delta % 1)
    relay._on_data(delta % 2 + delta % 3 + b"data: [DONE]\n\n")
    assert relay._next_sequence_number() == 4
    assert relay._next_sequence_number((delta % 4)[:-1]) == 5


class _Writer:
    """What the relay writes to the client, in order (the relay's writer, without a client)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, events: bytes) -> None:
        self.written.append(events)

    def finish(self, error: BaseException | None) -> None:
        raise AssertionError(f"the relay failed: {error!r}")


def _writing_relay(kind: StreamKind) -> tuple[SSEProxyResponse, list[bytes]]:
    relay = _relay(kind)
    writer = _Writer()
    relay._writer = writer  # type: ignore[assignment]
    return relay, writer.written
