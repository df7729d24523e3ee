"""The README's gateway examples (curl and OpenAI SDK), run verbatim against a real gateway.

Only the address is changed: the README says 127.0.0.1:8000, the test gateway takes a free port.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator

import pytest

from launch.process import EngineProcess
from tests.docs.readme_blocks import marked_blocks
from tests.gateway_server import GatewayServer, serve

pytestmark = pytest.mark.real_model  # the README's answer is the real model's

README_BASE = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def open_gateway(smollm2_engine: EngineProcess) -> Iterator[GatewayServer]:
    """A gateway with no keys (as in the README) in front of the embedded default's engine, named as in smollm2-cpu.yaml."""
    with serve({"smollm2": {"url": smollm2_engine.url, "aliases": ["default"]}}) as server:
        yield server


def test_readme_has_the_gateway_examples() -> None:
    langs = sorted(block.lang for block in marked_blocks("gateway"))
    assert langs == ["bash", "python"]


def test_readme_curl_example(open_gateway: GatewayServer) -> None:
    (block,) = [b for b in marked_blocks("gateway") if b.lang == "bash"]
    command = " ".join(line.rstrip("\\").strip() for line in block.code.splitlines() if not line.lstrip().startswith("#"))
    argv = shlex.split(command.replace(README_BASE, open_gateway.url))
    assert argv[0] == "curl"
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    body = json.loads(result.stdout)
    assert body["object"] == "chat.completion" and body["model"] == "smollm2"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == "The capital of France is Paris.", message  # as the README quotes it
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 8, body


# Run before the README's code (which is left as it is): records what each chat completion the example makes
# answered, so the test can tell what it should have printed. Written to stderr's last line as JSON.
RECORDER = """
import atexit, json, sys
from openai.resources.chat.completions import Completions

_create, _answers = Completions.create, []

def _recorded(self, *args, **kwargs):
    answer = _create(self, *args, **kwargs)
    if not kwargs.get("stream"):
        _answers.append({"content": answer.choices[0].message.content, "model": answer.model,
                         "completion_tokens": answer.usage.completion_tokens})
        return answer
    chunks = list(answer)  # read whole here, then handed to the example as they came
    _answers.append({"chunks": [chunk.model_dump() for chunk in chunks]})
    return iter(chunks)

Completions.create = _recorded
atexit.register(lambda: print(json.dumps(_answers), file=sys.stderr))
"""


def test_readme_python_sdk_example(open_gateway: GatewayServer) -> None:
    """The example prints the plain answer's text, then the stream's text; the stream ends with the usage it asks for."""
    (block,) = [b for b in marked_blocks("gateway") if b.lang == "python"]
    code = RECORDER + block.code.replace(README_BASE, open_gateway.url)
    # Bytes, decoded here: text mode would turn a "\r" the tiny model may generate into "\n" (universal newlines).
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=180, check=False)
    stdout, stderr = result.stdout.decode("utf-8"), result.stderr.decode("utf-8", "replace")
    assert result.returncode == 0, stderr[-2000:]
    plain, streamed = json.loads(stderr.strip().splitlines()[-1])
    assert plain["model"] == "smollm2" and 0 < plain["completion_tokens"] <= 16, plain
    chunks = streamed["chunks"]
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    assert stdout == f"{plain['content']}\n{text}", (stdout, plain, text)  # as print() writes them
    assert stdout.strip(), "the example printed nothing"  # (either answer may be one end-of-text token)
    assert {c["model"] for c in chunks} == {"smollm2"}
    finished = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finished in (["stop"], ["length"]), finished
    usage = chunks[-1]["usage"]  # stream_options.include_usage: the last chunk has the usage and no choices
    assert not chunks[-1]["choices"] and usage and 0 < usage["completion_tokens"] <= 16, chunks[-1]
