"""Start-up can be aborted (SIGTERM / Ctrl-C before the server serves): engines being started are stopped."""

from __future__ import annotations

import asyncio

import pytest

from gateway.app import app_from_config
from gateway.control.controller import StartAborted
from launch.config import DeploymentConfig
from tests.leaks import leaves_nothing
from tests.model_code.helpers import engine_children


@pytest.mark.usefixtures("starts_engine")
def test_abort_during_boot_stops_engines(tiny_deployment: DeploymentConfig) -> None:
    app, _ = app_from_config(tiny_deployment)
    controller = app.state.controller
    before = set(engine_children())

    async def scenario() -> None:
        booting = asyncio.ensure_future(controller.boot())
        await asyncio.sleep(2.0)
        assert not booting.done()
        for pid in set(engine_children()) - before:  # the engines being started
            check.watch(pid)
        controller.abort_start()  # what SIGTERM / Ctrl-C does before the server serves
        with pytest.raises(StartAborted):
            await asyncio.wait_for(booting, 30)
        await controller.close()

    with leaves_nothing() as check:
        asyncio.run(scenario())
        assert check.groups, "no engine was starting"
    assert controller.registry.routes() == ()  # nothing half-started was installed
