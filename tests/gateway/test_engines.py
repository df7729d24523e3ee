"""Start-up can be aborted (SIGTERM / Ctrl-C before the server serves): engines being started are stopped.

The engine is a FAKE one (tests/fake_engine.py, the config's ``python:``) that takes 60 s to listen: the abort
and the stop of an engine being started are the gateway's; a real engine's start is tested everywhere else."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.app import app_from_config
from gateway.control.controller import StartAborted
from launch.config import DeploymentConfig
from tests.fake_engine import fake_engine_python
from tests.leaks import leaves_nothing
from tests.model_code.helpers import engine_children


def test_abort_during_boot_stops_engines(tiny_deployment: DeploymentConfig, tmp_path: Path) -> None:
    data = tiny_deployment.model_dump(mode="json", exclude_unset=True)
    data["models"]["tiny"]["engine"].update(python=str(fake_engine_python(tmp_path)), env={"FAKE_ENGINE_START_S": "60"})
    app, _ = app_from_config(DeploymentConfig.model_validate(data))
    controller = app.state.controller
    before = set(engine_children())

    async def scenario() -> None:
        booting = asyncio.ensure_future(controller.boot())
        deadline = time.monotonic() + 60  # the fake listens after 60 s: until then its engine is starting
        while not (starting := set(engine_children()) - before):  # on a loaded machine the spawn takes a while
            assert not booting.done() and time.monotonic() < deadline, "no engine was started"
            await asyncio.sleep(0.1)
        for pid in starting:  # the engines being started
            check.watch(pid)
        controller.abort_start()  # what SIGTERM / Ctrl-C does before the server serves
        with pytest.raises(StartAborted):
            await asyncio.wait_for(booting, 30)
        await controller.close()

    with leaves_nothing() as check:
        asyncio.run(scenario())
        assert check.groups, "no engine was starting"
    assert controller.registry.routes() == ()  # nothing half-started was installed
