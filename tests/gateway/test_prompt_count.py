"""What asks the engine's tokenizer for a prompt it did not report (gateway.data.prompt_count.tokenize_request)."""

from __future__ import annotations

from gateway.data.prompt_count import tokenize_request

NEW = frozenset({"messages", "prompt", "tools", "tool_choice", "chat_template_kwargs"})  # 0.5.23's /v1/tokenize fields


def test_chat_and_completions_ask_for_what_shapes_their_prompt() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [], "temperature": 0.5}
    assert tokenize_request("/v1/chat/completions", chat, NEW) == {"model": "m", "messages": chat["messages"], "tools": []}
    assert tokenize_request("/v1/chat/completions", chat, frozenset({"prompt"})) is None  # an engine that cannot render chat
    assert tokenize_request("/v1/completions", {"model": "m", "prompt": [[1, 2], [3]]}, NEW) == 3  # token ids: counted here
    assert tokenize_request("/v1/completions", {"model": "m", "prompt": "hi"}, NEW) == {"model": "m", "prompt": "hi"}


def test_a_plain_text_messages_request_is_rendered_as_sglang_renders_it() -> None:
    body = {"model": "m", "system": "Be brief.", "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
                         {"role": "user", "content": "more"}]}  # fmt: skip
    assert tokenize_request("/v1/messages", body, NEW) == {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "more"},
    ]}  # fmt: skip
    assert tokenize_request("/v1/messages", {**body, "system": "  "}, NEW)["messages"][0] == {"role": "user", "content": "hi"}  # type: ignore[index]


def test_messages_the_gateway_cannot_render_are_left_to_the_bound() -> None:
    text = [{"role": "user", "content": "hi"}]
    two_blocks = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]
    for body in ({"messages": text, "tools": [{"name": "t"}]}, {"messages": two_blocks}, {"messages": image},
                 {"messages": text, "system": [{"type": "text", "text": "s"}]}, {"messages": []}):  # fmt: skip
        assert tokenize_request("/v1/messages", {"model": "m", **body}, NEW) is None, body
    assert tokenize_request("/v1/messages", {"model": "m", "messages": text}, frozenset({"prompt"})) is None  # 0.5.10's route
