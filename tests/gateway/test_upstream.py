"""``url:`` models: the gateway sends ``served_model_name`` upstream as ``model``, and ``api_key`` as a bearer key.

The upstream that checks the key is a real OpenAI-compatible server: a second gateway with its own
``api_keys``, in front of the session's tiny engine. Without the key it answers 401; with it, 200.
"""

from __future__ import annotations

import openai
import pytest

from launch.process import EngineProcess
from tests.gateway_server import KEY, serve

UPSTREAM_KEY = "upstream-secret-key"
HELLO = [{"role": "user", "content": "Hello"}]


def test_served_model_name_and_api_key_reach_the_upstream(tiny_engine: EngineProcess) -> None:
    with serve({"tiny": {"url": tiny_engine.url}}, {"api_keys": [UPSTREAM_KEY]}) as upstream:
        models = {
            "remote": {"url": upstream.url, "served_model_name": "tiny", "api_key": UPSTREAM_KEY},
            "keyless": {"url": upstream.url, "served_model_name": "tiny"},
            "tiny": {"url": upstream.url, "api_key": UPSTREAM_KEY},  # served name defaults to the YAML key
            "unnamed": {"url": upstream.url, "api_key": UPSTREAM_KEY},
        }
        with serve(models, {"api_keys": [KEY]}) as gw:
            sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
            reply = sdk.chat.completions.create(model="remote", messages=HELLO, max_tokens=4, temperature=0)
            assert reply.model == "tiny" and reply.choices[0].message.role == "assistant"
            chunks = list(sdk.chat.completions.create(model="remote", messages=HELLO, max_tokens=4, temperature=0, stream=True))
            assert chunks and all(chunk.model == "tiny" for chunk in chunks)
            assert sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).model == "tiny"

            with pytest.raises(openai.AuthenticationError) as caught:  # the upstream refused: no key sent
                sdk.chat.completions.create(model="keyless", messages=HELLO, max_tokens=2)
            assert "missing API key" in caught.value.message
            with pytest.raises(openai.NotFoundError) as caught:  # "unnamed" went upstream under its own name
                sdk.chat.completions.create(model="unnamed", messages=HELLO, max_tokens=2)
            assert "'unnamed' does not exist" in caught.value.message

            # The key also goes with the gateway's own upstream calls (/v1/models for the context length).
            cards = {card.id: card for card in sdk.models.list().data}
            assert isinstance(cards["remote"].model_extra["context_length"], int)
            assert cards["keyless"].model_extra["context_length"] is None
            listing = gw.state.registry.resolve("remote").backend
            assert listing.served_name == "tiny" and listing.upstream_headers() == {"authorization": f"Bearer {UPSTREAM_KEY}"}
            assert UPSTREAM_KEY not in repr(gw.state.registry.routes())
