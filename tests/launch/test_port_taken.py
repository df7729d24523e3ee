"""A picked port taken before the engine binds it (``port: 0``): the engine is started again on another port;
a port the config names is not changed behind the user's back (the error says the port was taken).

The engine is the FAKE one (tests/fake_engine.py): it binds its port with uvicorn, as SGLang's server does, so a
taken port makes it exit with uvicorn's code 3 and log uvicorn's message, as the real engine would.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import launch.process
from launch.config import EngineConfig
from launch.lifecycle import start_ready
from launch.ports import pick_free_port
from launch.process import EngineExited
from tests.fake_engine import fake_engine_python


class _Healthy(BaseHTTPRequestHandler):
    """Answers 200 to everything, ``/health`` included: another engine on the port, as far as a probe can tell."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(params=["silent", "answering /health"])
def taken_port(request: pytest.FixtureRequest) -> Iterator[int]:
    """A port another process listens on: without answering, or answering ``/health`` 200 as another engine does
    (which must not pass for the new engine being ready)."""
    if request.param == "silent":
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", pick_free_port()))
            listener.listen()
            yield int(listener.getsockname()[1])
        return
    server = ThreadingHTTPServer(("127.0.0.1", pick_free_port()), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _fake_engine(tmp_path: Path, port: int) -> EngineConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return EngineConfig(model_path=str(model), device="cpu", python=str(fake_engine_python(tmp_path)), port=port, startup_timeout_s=60)


def test_a_picked_port_taken_before_the_engine_binds_it_is_picked_again(tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    picks = [taken_port]  # the first pick loses the race; the next ones are the real picker's
    monkeypatch.setattr(launch.process, "pick_free_port", lambda host="127.0.0.1": picks.pop() if picks else pick_free_port(host))
    engine = start_ready("raced", _fake_engine(tmp_path, 0), log_dir=tmp_path / "logs")
    try:
        assert engine.ready and engine.port != taken_port
        logs = sorted((tmp_path / "logs").glob("raced-*.log"))
        assert [log.name.split("-")[1] for log in logs] == sorted([str(taken_port), str(engine.port)]), logs
        lost = next(log for log in logs if f"-{taken_port}-" in log.name)
        assert "address already in use" in lost.read_text()  # the first attempt did bind (and fail) on the taken port
    finally:
        engine.stop()


def test_a_port_the_config_names_is_kept_and_its_loss_reported(tmp_path: Path) -> None:
    """The named port is free at preflight and taken (by the thread below) while the engine starts."""
    port = pick_free_port()
    logs = tmp_path / "logs"
    listening = threading.Event()

    def take_the_port_once_the_engine_started() -> None:
        deadline = time.monotonic() + 30
        while not list(logs.glob("fixed-*.log")) and time.monotonic() < deadline:
            time.sleep(0.05)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        listening.set()

    config = _fake_engine(tmp_path, port).model_copy(update={"env": {"FAKE_ENGINE_START_S": "3"}})
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        taker = threading.Thread(target=take_the_port_once_the_engine_started, daemon=True)
        taker.start()
        with pytest.raises(EngineExited) as caught:
            start_ready("fixed", config, log_dir=logs)
        taker.join(5)
    assert listening.is_set()
    assert caught.value.returncode == 3 and "address already in use" in str(caught.value)
    assert len(list(logs.glob("fixed-*.log"))) == 1  # one attempt: no retry on a port the user chose
