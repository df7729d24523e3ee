"""The engine manager behind the lifespan: a stop request during start-up stops the engines at once."""

from __future__ import annotations

import asyncio
import os

import pytest

from gateway.engines import EngineManager, StartAborted
from launch.config import DeploymentConfig

pytestmark = pytest.mark.engine


def test_abort_during_start_stops_engines(tiny_deployment: DeploymentConfig) -> None:
    manager = EngineManager(tiny_deployment)

    async def scenario() -> None:
        starting = asyncio.ensure_future(manager.start_all())
        await asyncio.sleep(2.0)
        assert not starting.done()
        manager.abort_start()
        with pytest.raises(StartAborted):
            await asyncio.wait_for(starting, 30)

    asyncio.run(scenario())
    for engine in manager.engines.values():
        assert engine.pid is not None and not engine.running
        with pytest.raises(ProcessLookupError):
            os.killpg(engine.pid, 0)
