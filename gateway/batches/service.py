"""The batch API's parts put together for one app: storage, the database, and (in the process that runs batches)
the runner with its adapter into the data plane. Opened and closed by the app's lifespan."""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.types import ASGIApp

from gateway.batches.dispatch import LineSender
from gateway.batches.files import FileStorage, LocalFiles
from gateway.batches.runner import BatchRunner
from gateway.batches.store import BatchStore
from gateway.config import GatewaySettings
from gateway.core.metrics import Metrics
from gateway.core.state import GatewayState
from gateway.edge.auth import KeyHolder
from gateway.tenants.ledger import database_url

FILES_DIR = "batch_files"


class Batches:
    def __init__(self, state: GatewayState, url: str, root: Path) -> None:
        self.state = state
        self.settings = state.settings.batches
        self.url = url
        self.files: FileStorage = LocalFiles(root)
        self.store: BatchStore | None = None
        self.runner: BatchRunner | None = None

    async def open(self, run: ASGIApp | None, app: object, keys: KeyHolder, metrics: Metrics) -> None:
        """The database (schema brought up to date); with ``run`` (the line chain, :func:`gateway.batches.dispatch.line_chain`),
        the runner too, which takes up every unfinished batch at once."""
        self.store = await asyncio.to_thread(BatchStore, self.url)
        if run is not None:
            sender = LineSender(run, app, keys, self.settings, self.state.settings.priority_classes)
            self.runner = BatchRunner(self.store, self.files, sender, self.settings, metrics)
            self.runner.start()

    async def close(self, grace_s: float) -> None:
        if self.runner is not None:
            await self.runner.close(grace_s)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)


def batches_for(state: GatewayState) -> Batches | None:
    """The batch API of a gateway with ``state``'s settings; None when it is off or has nowhere to keep files."""
    settings: GatewaySettings = state.settings
    url = database_url(settings)
    if not settings.batches.enabled or url is None or settings.state_dir is None:
        return None
    return Batches(state, url, Path(settings.state_dir) / FILES_DIR)
