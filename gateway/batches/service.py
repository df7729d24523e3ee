"""The batch API's parts put together for one app: storage, the database, and (in the process that runs batches)
the runner with its adapter into the data plane. Opened and closed by the app's lifespan.

The database is opened at its first need, not at start: a gateway that never uses the batch API creates no database
file, and a database down at start fails no start (the API answers 503 ``batches_unavailable`` meanwhile, the runner
tries again at each poll).

Replicas sharing one PostgreSQL (``gateway.replicas.shared``) keep files' bytes in it (:class:`DatabaseFiles`) and run
each batch under a lease named for the replica (``replicas.name``, else the host name and process id), of
``replicas.lease_s``; a lone gateway keeps them under ``state_dir`` and holds its leases as ``local``, so a gateway
restarted after a kill takes its batches up at once.

Every call of the database runs through :class:`gateway.batches.calls.BatchCalls` (bounded by
``usage.database_timeout_s`` on PostgreSQL: a hung server is a server down, 503 ``batches_unavailable``), and so does
the opening (its migration) and closing of the database: nothing waits on a frozen server past its bound."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from loguru import logger
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from starlette.types import ASGIApp

from gateway.batches.calls import CREATE_DEADLINES, BatchCalls, DeadlineExceeded
from gateway.batches.dispatch import LineSender
from gateway.batches.files import DatabaseFiles, FileStorage, LocalFiles
from gateway.batches.runner import BatchRunner
from gateway.batches.shapes import ACTIVE, BatchObject, FileObject
from gateway.batches.store import BatchStore
from gateway.config import GatewaySettings, KeyLimits
from gateway.core.errors import GatewayError
from gateway.core.metrics import Metrics
from gateway.core.shared_store import replica_name
from gateway.core.state import GatewayState
from gateway.edge.auth import KeyHolder
from gateway.tenants.ledger import database_url

T = TypeVar("T")
FILES_DIR = "batch_files"
LOCAL_HOLDER = "local"  # a lone gateway's lease holder: the same name after a restart


class Batches:
    def __init__(self, state: GatewayState, url: str, root: Path | None) -> None:
        self.state = state
        self.settings = state.settings.batches
        self.url = url
        replicas = state.settings.replicas
        self.holder = replica_name(replicas.name) if replicas.shared else LOCAL_HOLDER
        self.files: FileStorage = DatabaseFiles(self._engine) if replicas.shared or root is None else LocalFiles(root)
        self.deadline_s = state.settings.usage.database_timeout_s
        self.store: BatchStore | None = None
        self.calls: BatchCalls | None = None  # with the store: where its calls run
        self.runner: BatchRunner | None = None
        self._opening = asyncio.Lock()
        self._open_pool = ThreadPoolExecutor(1, thread_name_prefix="batch-open")  # one open at a time; a hung one holds only it

    async def open(self, run: ASGIApp | None, app: object, keys: KeyHolder, metrics: Metrics) -> None:
        """Open the database if it exists (schema brought up to date); with ``run`` (the line chain,
        :func:`gateway.batches.dispatch.line_chain`), start the runner, which takes up every unfinished batch."""
        try:
            await self.store_now(create=False)
        except Exception as error:  # noqa: BLE001 - said in one line; the API and the runner try again
            logger.warning("batches: the database cannot be opened ({}: {}); the batch API answers 503 until it can", type(error).__name__, error)
        if run is not None:
            sender = LineSender(run, app, keys, self.settings, self.state.settings.priority_classes)
            lease_s = self.state.settings.replicas.lease_s
            self.runner = BatchRunner(
                self.store_now, self.run, self.files, sender, self.settings, metrics, holder=self.holder, lease_s=lease_s, db_big=self.run_big,
                alone=self._alone(),
            )
            self.runner.start()

    async def store_now(self, create: bool) -> BatchStore | None:
        """The database, opened once. ``create=False``: None while an SQLite file does not exist yet (no batch can
        be waiting in it). Raises when it cannot be opened (:class:`DeadlineExceeded` when PostgreSQL does not answer
        within the bound of a create's big call: the opening migrates the schema)."""
        if self.store is None:
            async with self._opening:
                if self.store is None and (create or self._exists()):
                    store = await self._open()
                    self.calls = BatchCalls(store.engine, self.deadline_s, self.state.settings.http.body_deadline_s)
                    self.store = store
        return self.store

    async def _open(self) -> BatchStore:
        long_s = CREATE_DEADLINES * self.deadline_s  # the server's statement timeout: that of the longest call
        opening = asyncio.get_running_loop().run_in_executor(self._open_pool, BatchStore, self.url, self.deadline_s, long_s)
        if make_url(self.url).get_backend_name() == "sqlite":
            return await opening  # a local file: never cut (see gateway.batches.calls)
        try:
            return await asyncio.wait_for(asyncio.shield(opening), long_s)
        except TimeoutError:
            if opening.done():
                raise
            opening.add_done_callback(_closed_when_late)  # opened after all: its engine let go
            raise DeadlineExceeded(f"the batch database was not opened in {long_s:g} s") from None

    async def run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``work(*args, **kwargs)``, a call of the open database, bounded (:meth:`BatchCalls.run`)."""
        if self.calls is None:
            raise RuntimeError("the batch database is not open yet")
        return await self.calls.run(work, *args, **kwargs)

    async def run_big(self, work: Callable[..., T], *args: Any) -> T:
        """A call that moves a whole file or batch, bounded as a create's big call (:meth:`BatchCalls.run_big`)."""
        if self.calls is None:
            raise RuntimeError("the batch database is not open yet")
        return await self.calls.run_big(work, *args)

    async def reserve(self, store: BatchStore, row: dict[str, Any], input_owner: str | None) -> None:
        """Reserve ``row``'s batch before its lines are checked (counted in its key's limits from now on, so that
        concurrent creates of one key cannot all pass): 429 ``batch_limit_exceeded`` when the key has
        ``max_active_batches_per_key`` unfinished batches or ``max_queued_lines_per_key`` lines queued; 404 when
        ``input_owner``'s input file is gone."""
        limits = self.settings
        refused = await self.in_create_pool(store.reserve, row, limits.max_active_batches_per_key, limits.max_queued_lines_per_key, input_owner, big=False)
        if refused is None:
            return
        active, queued = refused
        if active < 0:
            raise GatewayError(404, f"No such File object: {row['input_file_id']}", code="file_not_found", param="input_file_id")
        if active >= limits.max_active_batches_per_key:
            raise GatewayError(429, f"this key has {active} batches in progress (gateway.batches.max_active_batches_per_key)", code="batch_limit_exceeded")
        raise GatewayError(
            429, f"this key has {queued} lines queued (gateway.batches.max_queued_lines_per_key: {limits.max_queued_lines_per_key})",
            code="batch_limit_exceeded",
        )  # fmt: skip

    def refuse_below_floor(self, adding: int) -> None:
        """507 when writing ``adding`` bytes would leave the state_dir's disk under ``min_free_bytes`` (files kept in
        the database: not this gateway's disk to watch)."""
        if not isinstance(self.files, LocalFiles) or not self.settings.min_free_bytes:
            return
        free = shutil.disk_usage(self.files.root).free
        if free - adding < self.settings.min_free_bytes:
            raise GatewayError(
                507, f"the gateway's disk has {free} bytes free; {adding} more would leave less than gateway.batches.min_free_bytes "
                f"({self.settings.min_free_bytes}); delete files or try later", code="insufficient_storage", param="file",
            )  # fmt: skip

    def refuse_over_quota(self, store: BatchStore, owner: str, quota: KeyLimits | None, adding: int) -> None:
        """413 ``file_quota_exceeded`` when one more file of ``adding`` bytes takes ``owner`` over its key's
        ``batch_files`` or ``batch_file_bytes`` (in a thread: it reads the database)."""
        if quota is None or (quota.batch_files is None and quota.batch_file_bytes is None):
            return
        _over_quota(*store.usage(owner), quota, adding)

    def add_upload(self, store: BatchStore, file_id: str, owner: str, quota: KeyLimits | None, filename: str, size: int) -> FileObject:
        """Record an uploaded file, its key's quotas counted again under the key's lock (concurrent uploads of one key
        cannot all pass); 413 when over them (in a thread: it writes the database)."""
        limits = (quota.batch_files, quota.batch_file_bytes) if quota is not None else (None, None)
        created = store.add_upload(file_id, owner, filename, size, *limits)
        if isinstance(created, tuple):
            assert quota is not None
            _over_quota(*created, quota, size)
        assert isinstance(created, FileObject)
        return created

    async def in_create_pool(self, work: Callable[..., T], *args: Any, big: bool = True, reads_body: bool = False) -> T:
        """Run a create's work (``work``: its reservation, the check of its lines, the insert of its lines, which
        waits for SQLite's one writer) in the creates' own threads: creates of big files never queue other keys'
        calls. Bounded as :meth:`BatchCalls.create` says (``big``: the check and the insert of its lines)."""
        if self.calls is None:
            raise RuntimeError("the batch database is not open yet")
        return await self.calls.create(work, *args, big=big, reads_body=reads_body)

    async def create(self, store: BatchStore, batch_id: str, custom_ids: list[str], noun: str = "lines") -> BatchObject:
        """Turn the reservation ``batch_id`` into a batch of ``custom_ids`` and wake the runner; 429 when they take the
        key's queued lines over ``max_queued_lines_per_key`` (the reservation is the caller's to drop)."""
        limit = self.settings.max_queued_lines_per_key
        created = await self.in_create_pool(store.fill_reservation, batch_id, custom_ids, limit)
        if isinstance(created, int):
            raise GatewayError(
                429, f"this key has {created} {noun} queued; {len(custom_ids)} more exceed gateway.batches.max_queued_lines_per_key ({limit})",
                code="batch_limit_exceeded",
            )  # fmt: skip
        if self.runner is not None:
            self.runner.wake()
        return created

    async def cancel(self, store: BatchStore, batch_id: str) -> None:
        """No line of ``batch_id`` starts from now on: ``cancelling`` in the database, and told to the runner here (a
        runner elsewhere sees it at its next poll); lines in flight finish."""
        await self.run(store.move, batch_id, "cancelling", tuple(ACTIVE - {"cancelling", "finalizing"}))
        if self.runner is not None:
            self.runner.cancel(batch_id)

    def _engine(self) -> Engine:
        """The database of :class:`DatabaseFiles` (opened by the API and the runner before they touch a file)."""
        if self.store is None:
            raise RuntimeError("the batch database is not open yet")
        return self.store.engine

    def _alone(self) -> bool:
        """No other process creates or cancels batches in this database: one process (no workers), not a replica of a
        shared store, on a local SQLite file. Its runner is then told of every batch and needs no poll to find them."""
        settings = self.state.settings
        sqlite = make_url(self.url).get_backend_name() == "sqlite"
        return sqlite and not settings.replicas.shared and settings.worker_count() == 1

    def _exists(self) -> bool:
        url = make_url(self.url)
        return url.get_backend_name() != "sqlite" or (url.database is not None and Path(url.database).exists())

    async def close(self, grace_s: float) -> None:
        """The runner stopped (within ``grace_s``, and a last bounded try of the answers it holds), then the database
        let go, bounded too: a frozen server holds no shutdown."""
        if self.runner is not None:
            await self.runner.close(grace_s)
        if self.store is not None and self.calls is not None:
            try:
                await self.calls.run(self.store.close)
            except Exception as error:  # noqa: BLE001 - its connections are cut; nothing left to wait for
                logger.warning("batches: the database was not let go cleanly ({})", type(error).__name__)
            self.calls.close()
        self._open_pool.shutdown(wait=False, cancel_futures=True)


def _closed_when_late(opening: asyncio.Future[BatchStore]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def _over_quota(files: int, size: int, quota: KeyLimits, adding: int) -> None:
    if quota.batch_files is not None and files + 1 > quota.batch_files:
        raise GatewayError(413, f"this key keeps {files} batch files (its limits.batch_files: {quota.batch_files}); delete some first", code="file_quota_exceeded", param="file")
    if quota.batch_file_bytes is not None and size + adding > quota.batch_file_bytes:
        raise GatewayError(
            413, f"this key keeps {size} bytes of batch files; {adding} more exceed its limits.batch_file_bytes ({quota.batch_file_bytes}); delete some first",
            code="file_quota_exceeded", param="file",
        )  # fmt: skip


def batches_for(state: GatewayState) -> Batches | None:
    """The batch API of a gateway with ``state``'s settings; None when it is off or has nowhere to keep files."""
    settings: GatewaySettings = state.settings
    url = database_url(settings)
    shared = settings.replicas.shared  # files in the database: no state_dir needed
    if not settings.batches.enabled or url is None or (settings.state_dir is None and not shared):
        return None
    return Batches(state, url, Path(settings.state_dir) / FILES_DIR if settings.state_dir is not None else None)


async def opened(request: Request) -> tuple[Batches, BatchStore]:
    """The app's batch API and its database, for a request of the batch API (the database opened at its first use:
    503 while it cannot be; 404 ``batches_off`` where the API is off)."""
    batches: Batches | None = getattr(request.app.state, "batches", None)
    if batches is None:
        raise GatewayError(404, "the batch API is off here (gateway.batches.enabled, and a state_dir for the files)", code="batches_off")
    try:
        store = await batches.store_now(create=True)
    except Exception as error:  # noqa: BLE001 - the database down or hung: said, never a 500 with a trace
        raise GatewayError(503, f"the batch database cannot be reached ({type(error).__name__}); try again later", code="batches_unavailable") from error
    assert store is not None
    return batches, store
