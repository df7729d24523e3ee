"""Each server class the project runs keeps the Protocol code relies on (launch/served.py): a property
renamed or dropped in one class fails here, not in whichever caller used it."""

from __future__ import annotations

from pathlib import Path

from launch.config import EngineConfig, RouterConfig
from launch.process import EngineProcess
from launch.router import RouterProcess
from launch.served import EngineServer, LaunchedServer, ServerProcess
from launch.shared import SharedEngine


def test_each_server_class_keeps_its_protocols(tmp_path: Path) -> None:
    config = EngineConfig(model_path=str(tmp_path), device="cpu")
    engine = EngineProcess("e", config, log_dir=tmp_path)  # not started: the checks read attributes only
    shared = SharedEngine("s", config, tmp_path, -1, log_dir=tmp_path, show_log=False)
    router = RouterProcess("r", RouterConfig(), tokenizer_path=str(tmp_path), api_key=None, log_dir=tmp_path)
    assert isinstance(engine, EngineServer) and isinstance(engine, LaunchedServer)
    assert isinstance(shared, EngineServer) and not isinstance(shared, LaunchedServer)  # others may own it
    assert isinstance(router, LaunchedServer) and isinstance(router, ServerProcess) and not isinstance(router, EngineServer)


def test_a_class_without_the_members_is_not_taken_for_one() -> None:
    class NotAServer:
        url = "http://127.0.0.1:1"

    assert not isinstance(NotAServer(), ServerProcess)
