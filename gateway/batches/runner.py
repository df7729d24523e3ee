"""Runs batches: their queued lines through the data plane, a bounded number at a time, then their result files.

One runner per gateway (the control process's; worker processes only create batches, which it finds in the
database every ``batches.poll_interval_s``, or at once when created in its own process). A runner ``alone`` with its
database (one process, a local SQLite file: every batch is created and cancelled where it runs) looks only when told
or while batches are unfinished there: an idle gateway without batches never polls. At start it takes up every
unfinished batch: the lines still ``queued`` in the database are exactly those whose end was never recorded, so a
restart after SIGKILL neither loses a line nor runs again one whose answer was recorded (each answer is recorded as
it arrives, in its own transaction). A line whose answer arrived but was not yet recorded when the process died (a
window of milliseconds per line in flight) runs again.

A line that meets a passing failure (429 of the key's rate limits or of the model's queue, 502/503/504: an engine
restarting, swapped, asleep or gone a moment) waits and is sent again (backoff from ``retry_backoff_s`` to 30 s), so
such events pause lines and never fail them; any other answer is the line's result. Cancel: no line starts from then
on, the lines in flight finish (their answers are kept in the output), the queued ones end as ``batch_cancelled``.
``expires_at``: lines not started by then end as ``batch_expired``. Shutdown: no line starts; those in flight get
``grace_s`` to finish, then are abandoned and stay queued for the next start.

Several gateways may share the database (replicas; or a lone gateway and its own restart): a runner runs a batch only
while it holds the batch's lease (:meth:`BatchStore.claim`, as ``holder`` for ``lease_s``), renewed every
``lease_s / 3``, released when the batch ends or the runner stops. A batch whose holder died is taken over by the
first runner to poll once its lease ran out; its lines recorded before are done, so only those the dead holder had in
flight run again. A holder that cannot renew for ``lease_s`` (the database unreachable), or finds its lease taken,
starts no more line of the batch and does not finish it (lines it has in flight still record their ends, once each).
Per batch rather than per line: one row written per renewal, not one per line, and the runner's order of work (the
input file read once, lines in order) stays; several batches spread over replicas, one batch runs on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing
from typing import Any, TypeVar

import orjson
from loguru import logger
from sqlalchemy.exc import SQLAlchemyError

from gateway.batches.dispatch import Answer, LineSender
from gateway.batches.files import FileStorage, jsonl_lines
from gateway.batches.results import result_files
from gateway.batches.shapes import ACTIVE, BatchObject
from gateway.batches.store import BatchStore, LineEnd
from gateway.batches.yielding import Yielding
from gateway.config import BatchSettings
from gateway.core.context import usage_counts
from gateway.core.endpoints import MESSAGES
from gateway.core.metrics import Metrics

T = TypeVar("T")
PASSING = frozenset({429, 502, 503, 504})
MAX_BACKOFF_S = 30.0
READ_LINES = 64  # input lines read at a time, in a thread
EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}
CANCELLED = {"code": "batch_cancelled", "message": "The batch was cancelled before this request started."}


class BatchRunner:
    store: BatchStore  # set by the loop once the database is open (no batch runs before)

    def __init__(
        self, connect: Callable[[bool], Awaitable[BatchStore | None]], db: Callable[..., Awaitable[Any]], files: FileStorage,
        sender: LineSender, settings: BatchSettings, metrics: Metrics, holder: str = "local", lease_s: float = 30.0,
        db_big: Callable[..., Awaitable[Any]] | None = None, alone: bool = False,
    ) -> None:
        self.connect = connect  # the database, or None while none exists yet (``Batches.store_now``)
        self.db = db  # runs one call of the open database, bounded (``Batches.run``: DeadlineExceeded is the store down)
        self.db_big = db_big or db  # one that moves a whole file or batch (``Batches.run_big``)
        self.files = files
        self.sender = sender
        self.settings = settings
        self.metrics = metrics
        self.holder = holder
        self.lease_s = lease_s
        self.alone = alone  # no other process creates or cancels batches in this database: no poll while none is unfinished
        self._lost: set[str] = set()  # batches whose lease this runner held and lost
        self._held: dict[str, dict[int, tuple[LineEnd, str]]] = {}  # answers whose record failed: (end, model) by line
        self._store_up = True  # the database answered the last call (a change is logged once, in one line)
        self._slots = asyncio.Semaphore(settings.max_concurrency)
        self._yielding = Yielding(sender.load, settings)  # fewer lines of a model while it serves interactive requests
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._cancelled: set[str] = set()
        self._batches: dict[str, asyncio.Task[None]] = {}
        self._lines: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._running_on: asyncio.AbstractEventLoop | None = None

    async def _db(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        result: T = await self.db(call, *args, **kwargs)
        return result

    def start(self) -> None:
        self._running_on = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._loop(), name="batch runner")

    def wake(self) -> None:
        """A batch was created: look now, not at the next poll. Safe from another thread (an ``asyncio.Event`` set
        there would not wake a loop that sleeps until told)."""
        loop = self._running_on
        if loop is None or _on_loop(loop):
            self._wake.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    def cancel(self, batch_id: str) -> None:
        """No line of ``batch_id`` starts from now on (its status is ``cancelling`` in the database already)."""
        self._cancelled.add(batch_id)
        self._wake.set()

    async def close(self, grace_s: float) -> None:
        """Start no line; let those in flight finish for ``grace_s``, then abandon them (they stay queued)."""
        self._stop.set()
        self._wake.set()
        tasks = [task for task in (self._task, *self._batches.values()) if task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s)
            for task in (*late, *self._lines):
                task.cancel()
            await asyncio.gather(*late, *self._lines, return_exceptions=True)
        if self._held:  # answers held for a database that failed: a last try (bounded: a hung one holds no shutdown)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(self._record_held(batch_id) for batch_id in list(self._held))), max(grace_s, 1.0))

    async def _loop(self) -> None:
        while not self._stop.is_set():
            quiet = False  # nothing to look for until woken (a create, a cancel, the stop)
            self._wake.clear()  # before the read: a create committed while it runs leaves the wake set for the wait below
            try:
                store = await self.connect(False)  # None: no database yet, so no batch
                if store is not None:
                    self.store = store
                unfinished = await self._db(store.unfinished) if store is not None else []
                waiting = 0
                self._cancelled &= {batch.id for batch in unfinished}  # those another replica ended
                for batch in unfinished:
                    counts = batch.request_counts
                    waiting += counts.total - counts.completed - counts.failed
                    if batch.status == "cancelling":
                        self._cancelled.add(batch.id)
                    if batch.id not in self._batches:
                        self._batches[batch.id] = asyncio.create_task(self._run(batch), name=f"batch {batch.id}")
                self.metrics.batch_queued.set(waiting)
                if not unfinished:
                    self._store_state(None)  # (with batches to run, a claim's write says whether it is back)
                    quiet = self.alone
            except Exception as error:  # noqa: BLE001 - a database down: try again at the next poll
                self._store_state(error)
            if quiet:
                await self._wake.wait()
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_interval_s)
            except TimeoutError:
                pass

    async def _run(self, batch: BatchObject) -> None:
        try:
            if not await self._db(self.store.claim, batch.id, self.holder, self.lease_s):
                return  # another gateway runs it: looked at again at each poll, taken over once its lease runs out
            renewing = asyncio.create_task(self._renew(batch.id), name=f"lease {batch.id}")
            try:
                await self._run_leased(await self._db(self.store.batch, batch.id, None) or batch)
            finally:
                renewing.cancel()
                self._lost.discard(batch.id)
                await self._release(batch.id)
            self._store_state(None)  # a whole run without a database error: it answers
        except Exception as error:  # noqa: BLE001 - logged; the batch is taken up again at the next poll
            if _database_error(error):
                self._store_state(error)  # one line when the database goes away, not a trace per batch and poll
            else:
                logger.exception("batches: batch {} stopped on an error; it is taken up again", batch.id)
            await asyncio.sleep(self.settings.poll_interval_s)
        finally:
            self._batches.pop(batch.id, None)

    async def _run_leased(self, batch: BatchObject) -> None:
        if batch.status == "validating":
            await self._db(self.store.move, batch.id, "in_progress", ("validating",))
        if batch.status in ("validating", "in_progress"):
            try:
                await self._run_lines(batch)
            except FileNotFoundError:
                await self._fail(batch, "input_file_missing", f"the input file {batch.input_file_id} is gone; the lines not yet run cannot run")
                return
        if not self._stop.is_set() and batch.id not in self._lost and not self._held.get(batch.id):
            await self._finish(batch)  # (answers held unrecorded: paused, taken up again at the next poll)

    async def _renew(self, batch_id: str) -> None:
        """Renew the lease every ``lease_s / 3``; lost when another holds it, or after ``lease_s`` without a renewal
        (the database may have let it run out: another replica may run the batch by then)."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.lease_s / 3)
            asked = time.monotonic()  # the lease runs until at least this + lease_s once this renewal is written
            try:
                if not await self._db(self.store.renew, batch_id, self.holder, self.lease_s):
                    logger.warning("batches: the lease of batch {} was taken over; its lines here stop", batch_id)
                    self._lost.add(batch_id)
                    return
                renewed = asked
            except Exception as error:  # noqa: BLE001 - the database away a moment: try again until the lease is gone
                if time.monotonic() - renewed >= self.lease_s:
                    logger.warning("batches: the lease of batch {} could not be renewed for {:g} s ({}); its lines here stop", batch_id,
                                   self.lease_s, type(error).__name__)  # fmt: skip
                    self._lost.add(batch_id)
                    return

    async def _release(self, batch_id: str) -> None:
        try:
            await self._db(self.store.release, batch_id, self.holder)
        except Exception as error:  # noqa: BLE001 - the lease then runs out by itself (a lone gateway: its own, taken back)
            if self._store_up:
                logger.warning("batches: the lease of batch {} could not be released ({}); it runs out in {:g} s", batch_id,
                               type(error).__name__, self.lease_s)  # fmt: skip
            raise

    def _store_state(self, error: Exception | None) -> None:
        """Log the database going away or coming back, once each (one line), never at every poll."""
        if error is not None and self._store_up:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            logger.warning("batches: the database fails ({}: {}); batches pause until it answers", type(error).__name__, first[:200])
        elif error is None and not self._store_up:
            logger.info("batches: the database answers again; batches resume")
        self._store_up = error is None

    def _stopped(self, batch: BatchObject) -> bool:
        return (
            self._stop.is_set() or batch.id in self._cancelled or batch.id in self._lost or bool(self._held.get(batch.id))
            or (batch.expires_at is not None and time.time() >= batch.expires_at)
        )  # fmt: skip

    async def _run_lines(self, batch: BatchObject) -> None:
        if not await self._record_held(batch.id):
            return  # the database still refuses: the batch stays paused, its answers held
        queued = set(await self._db(self.store.queued, batch.id))
        whose = await self._db(self.store.owner_of, batch.id)
        if not queued or whose is None:
            return
        mine: set[asyncio.Task[None]] = set()
        try:
            async with aclosing(self._input(batch.input_file_id)) as lines:
                async for index, raw in lines:
                    if index not in queued:
                        continue
                    await self._slots.acquire()
                    body, model = _read(raw)
                    await self._yielding.enter(model, lambda: self._stopped(batch))
                    if self._stopped(batch):
                        self._yielding.leave(model)
                        self._slots.release()
                        break
                    task = asyncio.create_task(self._line(batch, whose[0], index, body, model))
                    for group in (mine, self._lines):
                        group.add(task)
                        task.add_done_callback(group.discard)
        finally:  # the lines in flight end (and record, or hold, their answers) before the batch is let go
            await asyncio.gather(*mine, return_exceptions=True)

    async def _record(self, batch_id: str, index: int, end: LineEnd, model: str) -> None:
        """Record a line's end; when the database refuses (a full disk, a blip), hold the answer here and pause the
        batch: no line of it starts until the held answers are recorded, and a held line is never sent again (it
        ran, and was charged, once)."""
        try:
            await self._end_line(batch_id, index, end, model)
        except Exception as error:  # noqa: BLE001 - said once; the answer waits here for the database
            held = self._held.setdefault(batch_id, {})
            if not held:
                logger.warning("batches: the answer of line {} of batch {} could not be recorded ({}: {}); the batch pauses, its answers held until "
                               "the database takes them", index, batch_id, type(error).__name__, str(error).strip().split("\n")[0][:200])  # fmt: skip
            held[index] = (end, model)

    async def _end_line(self, batch_id: str, index: int, end: LineEnd, model: str) -> None:
        if await self._db(self.store.end_line, batch_id, index, end):
            self.metrics.child(self.metrics.batch_lines, model, "done" if end.status_code == 200 else "failed").inc()

    async def _record_held(self, batch_id: str) -> bool:
        """Record the answers held for ``batch_id`` (:meth:`_record`); True once none is left."""
        held = self._held.get(batch_id, {})
        for index, (end, model) in sorted(held.items()):
            try:
                await self._end_line(batch_id, index, end, model)
            except Exception:  # noqa: BLE001 - still refused: stays paused (said when it paused)
                return False
            del held[index]
        self._held.pop(batch_id, None)
        return True

    async def _input(self, file_id: str) -> AsyncIterator[tuple[int, bytes]]:
        """(index, line) of the input file, read :data:`READ_LINES` at a time in a thread (off the event loop: a file
        in the database is read over the network)."""
        stream = await self._db(self.files.open, file_id)
        try:
            lines = jsonl_lines(stream)
            while group := await self._db(_take, lines, READ_LINES):
                for index, _, raw in group:
                    yield index, raw
        finally:
            stream.close()

    async def _line(self, batch: BatchObject, owner: str, index: int, body: Any, model: str) -> None:
        try:
            end = await self._answer(batch, owner, index, body, model)
            if end is not None:
                await self._record(batch.id, index, end, model)
        finally:
            self._yielding.leave(model)
            self._slots.release()

    async def _answer(self, batch: BatchObject, owner: str, index: int, body: Any, model: str) -> LineEnd | None:
        """How the line ended; None: it did not (cancelled or expired while it waited to be sent again: it ends so at
        the batch's finish). Cancelled (shutdown): it stays queued. A line that could not be read fails."""
        try:
            if isinstance(body, Exception):
                raise body
            payload = orjson.dumps(body)
            request_id = f"{batch.id}-{index}"
            backoff = self.settings.retry_backoff_s
            while _passing(answer := await self._send(batch, payload, owner, request_id, model)):
                if self._stopped(batch):
                    return None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            return _end(answer, request_id)
        except Exception as error:  # noqa: BLE001 - the gateway's own failure: the line fails, not the batch
            logger.exception("batches: line {} of {} failed in the gateway", index, batch.id)
            return LineEnd("failed", result={"code": "internal_error", "message": type(error).__name__})

    async def _send(self, batch: BatchObject, payload: bytes, owner: str, request_id: str, model: str) -> Answer:
        with self._yielding.sent(model):
            return await self.sender.send(batch.endpoint, payload, owner, batch.id, request_id)

    async def _finish(self, batch: BatchObject) -> None:
        """End a batch whose lines stopped: completed, cancelled or expired, with its result files."""
        status = await self._db(self.store.status, batch.id)
        left = await self._db(self.store.queued, batch.id)
        if status == "cancelling" or batch.id in self._cancelled:
            await self._db(self.store.end_queued, batch.id, "cancelled", CANCELLED)
            final, source = "cancelled", ("cancelling", "validating", "in_progress")
        elif left and batch.expires_at is not None and time.time() >= batch.expires_at:
            expired = await self._db(self.store.end_queued, batch.id, "expired", EXPIRED)
            self.metrics.child(self.metrics.batch_lines, "-", "expired").inc(expired)
            final, source = "expired", ("in_progress",)
        elif not left:
            await self._db(self.store.move, batch.id, "finalizing", ("in_progress",))
            final, source = "completed", ("finalizing",)
        else:
            return  # lines left (stopped without ending them): taken up again at the next poll
        output_id, errors_id = await self._write_results(batch)
        if await self._db(self.store.move, batch.id, final, source, output_file_id=output_id, error_file_id=errors_id):
            self._cancelled.discard(batch.id)
            logger.info("batches: batch {} {}", batch.id, final)

    async def _fail(self, batch: BatchObject, code: str, message: str) -> None:
        """End ``batch`` as ``failed`` with why (OpenAI's ``errors`` list), its lines not run ending so too; the
        lines that ran keep their answers, in its result files."""
        await self._db(self.store.end_queued, batch.id, "failed", {"code": code, "message": message})
        output_id, errors_id = await self._write_results(batch)
        errors = json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]})
        if await self._db(self.store.move, batch.id, "failed", tuple(ACTIVE), output_file_id=output_id, error_file_id=errors_id, errors=errors):
            logger.warning("batches: batch {} failed: {}", batch.id, message)

    async def _write_results(self, batch: BatchObject) -> tuple[str | None, str | None]:
        if batch.endpoint == MESSAGES:
            return None, None  # a Message Batch's results are read from its lines (gateway.batches.anthropic)
        lines = await self.db_big(self.store.ended_lines, batch.id)
        whose = await self._db(self.store.owner_of, batch.id)
        assert whose is not None
        output, errors = result_files(batch.id, lines)
        ids: list[str | None] = []
        stem = batch.id.removeprefix("batch_")
        for kind, data in (("output", output), ("errors", errors)):
            if not data:
                ids.append(None)
                continue
            file_id = f"file-{stem}-{kind}"  # the same id when a finalization is redone after a restart
            size = await self.db_big(self.files.write, file_id, data)
            await self._db(self.store.add_file, file_id, whose[0], "batch_output", f"{batch.id}_{kind}.jsonl", size)
            ids.append(file_id)
        return ids[0], ids[1]


def _read(raw: bytes) -> tuple[Any, str]:
    """A line's body (read once: what it sends) and the model it names (its metrics label, and whose engine it yields
    to interactive requests; "-" if none). A line that cannot be read (every line was checked at the batch's
    creation) gives the error, which fails it when it runs."""
    try:
        body = orjson.loads(raw)["body"]
    except Exception as error:  # noqa: BLE001 - any shape of unreadable line fails that line only
        return error, "-"
    return body, str(body.get("model", "-")) if isinstance(body, dict) else "-"


def _database_error(error: BaseException) -> bool:
    """The database (or the disk under it) failing, as opposed to a bug: said in one line, not with a trace."""
    return isinstance(error, SQLAlchemyError | OSError) and not isinstance(error, FileNotFoundError)


def _take(lines: Iterator[T], count: int) -> list[T]:
    return list(itertools.islice(lines, count))


def _passing(answer: Answer) -> bool:
    """A failure that passes (retried): 429 of a rate or the queue (not a spent budget), 502/503/504."""
    return answer.status in PASSING and not (answer.status == 429 and b"insufficient_quota" in answer.body)


def _end(answer: Answer, request_id: str) -> LineEnd:
    try:
        body: Any = orjson.loads(answer.body) if answer.body else None
    except orjson.JSONDecodeError:
        body = {"error": {"code": "invalid_answer", "message": answer.body[:300].decode("utf-8", "replace")}}
    usage = body.get("usage") if isinstance(body, dict) else None
    prompt, completion, _ = usage_counts(usage if isinstance(usage, dict) else {})
    return LineEnd("done", answer.status, request_id, body, prompt, completion)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread
        return False
