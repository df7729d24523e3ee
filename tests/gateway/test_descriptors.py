"""File descriptors: the gateway raises its own open-file limit at start (no warning on the default config),
and running out of descriptors answers 503 naming the gateway's limit, not the engine (a FAKE engine here)."""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fake_engine import running_fake_engine
from tests.gateway_server import serve
from tests.servers import CLI, ServerProcess


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_fake_engine(tmp_path_factory.mktemp("fake")) as url:
        yield url


def _soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc/<pid>/limits")


def test_the_gateway_raises_its_soft_limit_at_start_without_a_warning(engine_url: str, tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"models": {"m": {"url": engine_url}}}))  # the default config otherwise
    argv = ["prlimit", f"--nofile=512:{hard}", "--", *CLI, "serve", str(config), "--port", "{port}"]
    server = ServerProcess(argv, log_path=tmp_path / "gateway.log")
    try:
        server.wait_http("/health", timeout_s=60)
        assert _soft_nofile(server.pid) == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
        assert "below the" not in server.log() and "cannot raise" not in server.log(), server.log()
    finally:
        assert server.stop(signal.SIGTERM, grace_s=30) == 0


def test_out_of_descriptors_answers_503_naming_the_gateways_limit(engine_url: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with serve({"m": {"url": engine_url}}) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        assert http.get("/health").status_code == 200  # the client's connection is open (and accepted) now
        for stream in (True,):  # a stream's first upstream connection (a plain request may reuse a pooled one)
            in_use = os.open("/dev/null", os.O_RDONLY)  # the lowest free descriptor: a limit of it leaves none free
            os.close(in_use)
            resource.setrlimit(resource.RLIMIT_NOFILE, (in_use, hard))  # this process (the gateway's) is full
            try:
                answer = http.post("/v1/chat/completions", json={**body, "stream": stream})
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert error["code"] == "gateway_out_of_descriptors" and f"open-file limit, {in_use}" in error["message"], error
            assert "unreachable" not in error["message"]
        assert http.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 200  # room again: served


def test_a_plain_request_out_of_descriptors_names_the_gateways_limit_too() -> None:
    import errno

    import aiohttp
    from aiohttp.client_reqrep import ConnectionKey

    from gateway.data.upstream_errors import transport_error

    key = ConnectionKey("127.0.0.1", 1, False, True, None, None, None)
    error = transport_error(aiohttp.ClientConnectorError(key, OSError(errno.EMFILE, "Too many open files")), "m")
    assert error.status == 503 and error.code == "gateway_out_of_descriptors" and "open-file limit" in error.message
    assert transport_error(aiohttp.ClientConnectorError(key, OSError(errno.ECONNREFUSED, "refused")), "m").code == "engine_unavailable"
