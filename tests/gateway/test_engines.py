"""The engine manager behind the lifespan: a stop request during start-up stops the engines at once."""

from __future__ import annotations

import asyncio

import pytest

from gateway.engines import EngineManager, StartAborted
from launch.config import DeploymentConfig
from tests.leaks import leaves_nothing


@pytest.mark.usefixtures("starts_engine")
def test_abort_during_start_stops_engines(tiny_deployment: DeploymentConfig) -> None:
    manager = EngineManager(tiny_deployment)

    async def scenario() -> None:
        starting = asyncio.ensure_future(manager.start_all())
        await asyncio.sleep(2.0)
        assert not starting.done()
        for engine in manager.engines.values():
            check.watch(engine.pid)
        manager.abort_start()
        with pytest.raises(StartAborted):
            await asyncio.wait_for(starting, 30)

    with leaves_nothing() as check:
        asyncio.run(scenario())
        assert check.groups and all(not engine.running for engine in manager.engines.values())
