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
from tests.gateway.helpers import GatewayServer, serve

README_BASE = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def open_gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    """A gateway with no keys (as in the README) in front of the session's engine, named as in tiny-cpu.yaml."""
    with serve({"tiny": {"url": tiny_engine.url, "aliases": ["default"]}}) as server:
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
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_readme_python_sdk_example(open_gateway: GatewayServer) -> None:
    (block,) = [b for b in marked_blocks("gateway") if b.lang == "python"]
    code = block.code.replace(README_BASE, open_gateway.url)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip(), "the example printed nothing"
