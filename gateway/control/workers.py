"""Worker processes: the data plane on several cores, the engines in one control process.

With ``gateway.workers: N`` (N > 1) the process started by ``sglang-gateway serve`` becomes the control
process: it boots the engines, then starts N workers (``python -m gateway.worker``), each accepting on the
public port with a socket of its own (``SO_REUSEPORT``: the kernel spreads connections). The control keeps
the engines, routers, reloads, swaps, the watchdog and the admin API (served on a Unix socket that the
workers forward ``/admin/*`` to), and sends every worker the routing state whenever it changes
(:mod:`gateway.control.snapshot`). Workers report back what the control needs: their requests in flight per
backend (a drain waits for them), and the request shapes whose upstream connection broke (the poison
quarantine, then sent to every worker).

Draining (SIGTERM with ``gateway.shutdown_delay_s``): the control process's state turns ``draining``; the workers
are told at once (and any worker started meanwhile at its hello), so that their ``/ready`` answers 503 while they
still serve; the control's SIGTERM at the end of the delay stops each of them at once (their requests finish
within ``gateway.shutdown_grace_s``).

Faults: a worker that exits is started again (with a backoff while it keeps failing); the workers die
with the control process (parent-death signal), and the control's engines die with it too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger
from prometheus_client import multiprocess

from gateway.control import channel
from gateway.control.snapshot import RoutingState, capture_state
from gateway.core.endpoints import listening_note
from gateway.core.poison import Suspicion
from gateway.core.state import GatewayState
from gateway.edge.auth import KeyHolder
from gateway.tenants.quotas import Quotas
from launch.procgroup import set_parent_death_signal

HUB_SOCKET = "hub.sock"  # the workers' channel to the control process
ADMIN_SOCKET = "admin.sock"  # the control process's own HTTP server (admin API), reached by the workers
METRICS_DIR = "metrics"  # PROMETHEUS_MULTIPROC_DIR of the control process and its workers
PUBLISH_INTERVAL_S = 0.05  # how often the control compares the routing state with the one last sent
_RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)
_STABLE_AFTER_S = 60.0  # a worker up this long has its restart backoff reset


@dataclass(frozen=True)
class WorkerPlan:
    """What the control process needs to start its workers."""

    count: int
    runtime_dir: Path  # private (0700): the channel's and the admin API's sockets, the metrics directory
    host: str
    port: int
    verbose: bool = False


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    writer: asyncio.StreamWriter | None = None
    listening: asyncio.Event = field(default_factory=asyncio.Event)
    applied: int = 0  # the routing state version it last confirmed
    synced: int = 0  # the last sync round it answered (its report then was fresh)
    in_flight: dict[tuple[str, str], int] = field(default_factory=dict)
    restarts: int = 0
    failures_in_a_row: int = 0
    started_at: float = 0.0
    next_start: float = 0.0


class WorkerSupervisor:
    """Starts, feeds, watches and stops the data-plane workers of one control process (also its ``state.peers``)."""

    def __init__(
        self, state: GatewayState, keys: KeyHolder, count: int, runtime_dir: Path, *, host: str, port: int, verbose: bool = False,
        quotas: Quotas | None = None,
    ) -> None:
        self.state, self.keys, self.count, self.runtime_dir = state, keys, count, runtime_dir
        self.host, self.port, self.verbose = host, port, verbose
        self.workers = [_Worker(index) for index in range(count)]
        self.version = 0
        self._sync = 0
        self._upstream: dict[tuple[str, str], list[Suspicion]] = {}  # (model, identity) -> (shape, key) reported in a sync round
        self._sent: RoutingState | None = None
        self.quotas = quotas if quotas is not None else Quotas()  # every named key's use, summed over the workers
        self._quotas_sent: Any = None
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False
        self._drain_sent = False  # the workers were told that the control process drains

    # ------------------------------------------------------------------ life cycle
    async def start(self, timeout_s: float = 120.0) -> None:
        """Open the channel, start every worker and wait until each one listens on the port."""
        self.publish()
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.runtime_dir / HUB_SOCKET))
        os.chmod(self.runtime_dir / HUB_SOCKET, 0o600)
        for worker in self.workers:
            self._spawn(worker)
        waits = [asyncio.ensure_future(worker.listening.wait()) for worker in self.workers]
        deadline = time.monotonic() + timeout_s
        try:
            while not all(wait.done() for wait in waits):
                dead = [w for w in self.workers if w.proc is not None and w.proc.poll() is not None]
                if dead:
                    raise RuntimeError(f"worker {dead[0].index} exited with code {dead[0].proc.returncode} while starting")  # type: ignore[union-attr]
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the workers did not listen on port {self.port} within {timeout_s:.0f} s")
                await asyncio.sleep(0.05)
        finally:
            for wait in waits:
                wait.cancel()
        self._tasks = [asyncio.create_task(self._publish_loop()), asyncio.create_task(self._watch_loop())]
        logger.info("gateway: {} worker processes listening on {} (pids {})", self.count,
                    listening_note(self.host, self.port, self.state.settings.status_page),
                    ", ".join(str(w.proc.pid) for w in self.workers if w.proc))  # fmt: skip

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every worker (each drains its requests for up to ``grace_s``), then SIGKILL what is left."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        procs = [w.proc for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 5.0
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for proc in procs:
            if proc.poll() is None:
                logger.warning("gateway: worker pid {} still running {:.0f} s after SIGTERM; killing it", proc.pid, grace_s + 5)
                proc.kill()
                await asyncio.to_thread(proc.wait)
        for worker in self.workers:
            if worker.writer is not None:
                worker.writer.close()
        if self._server is not None:
            self._server.close()

    def _spawn(self, worker: _Worker) -> None:
        argv = [sys.executable, "-m", "gateway.worker", "--runtime-dir", str(self.runtime_dir), "--index", str(worker.index),
                "--parent", str(os.getpid()), "--workers", str(self.count)]  # fmt: skip
        if self.verbose:
            argv.append("--verbose")
        worker.listening.clear()
        worker.writer, worker.applied, worker.in_flight = None, 0, {}
        self.quotas.forget_worker(worker.index)
        # Its own process group is the control's: Ctrl-C in a terminal reaches every worker as well.
        worker.proc = subprocess.Popen(argv, preexec_fn=set_parent_death_signal)
        worker.started_at = time.monotonic()

    async def _watch_loop(self) -> None:
        """Start again every worker that exited, sooner the longer it had been up."""
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for worker in self.workers:
                proc = worker.proc
                if proc is None or proc.poll() is None:
                    if proc is not None and worker.failures_in_a_row and now - worker.started_at > _STABLE_AFTER_S:
                        worker.failures_in_a_row = 0
                    continue
                if worker.next_start == 0.0:
                    multiprocess.mark_process_dead(proc.pid, str(self.runtime_dir / METRICS_DIR))
                    delay = _RESTART_BACKOFF_S[min(worker.failures_in_a_row, len(_RESTART_BACKOFF_S) - 1)]
                    worker.next_start = now + delay
                    worker.failures_in_a_row += 1
                    logger.error("gateway: worker {} (pid {}) exited with code {}; starting it again in {:.0f} s",
                                 worker.index, proc.pid, proc.returncode, delay)  # fmt: skip
                    if worker.writer is not None:
                        worker.writer.close()
                        worker.writer = None
                if now >= worker.next_start:
                    worker.next_start = 0.0
                    worker.restarts += 1
                    self._spawn(worker)

    # ------------------------------------------------------------------ the routing state, out
    def publish(self) -> bool:
        """Take the routing state now; when it differs from the last one sent, number it and send it to every
        connected worker. Returns True when something new went out. The named keys' quotas likewise, and that the
        gateway drains (once)."""
        if self.state.draining and not self._drain_sent:
            self._drain_sent = True
            for worker in self.workers:
                self._send(worker, ("drain", 0, None))
        quotas = (self.quotas.snapshot(self.keys.policy.limited), dict(self.quotas.absorbed))
        if quotas != self._quotas_sent:
            self._quotas_sent = quotas
            for worker in self.workers:
                if worker.writer is not None:
                    self._send(worker, ("quota", 0, quotas))
        current = capture_state(self.state.settings, self.keys.policy, self.state.registry, self.state.quarantine)
        if current == self._sent:
            return False
        self._sent = current
        self.version += 1
        for worker in self.workers:
            if worker.writer is not None:
                self._send(worker, ("state", self.version, current))
        return True

    def _send(self, worker: _Worker, message: Any) -> None:
        writer = worker.writer
        if writer is None or writer.is_closing():
            return
        try:
            channel.write(writer, message)
        except (ConnectionError, RuntimeError) as error:
            logger.warning("gateway: worker {}: channel lost ({})", worker.index, error)

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            self.publish()

    async def settle(self, timeout_s: float) -> bool:
        """Send the routing state as it is now, then ask every worker for a fresh report, and wait until each
        connected worker answered (or ``timeout_s``): after it, every worker routes with this state, and the
        in-flight counts and broken-connection shapes held here are as of now."""
        return await self._sync_round(timeout_s, None)

    async def upstream_shapes(self, model: str, identity: str, timeout_s: float) -> list[Suspicion]:
        """The shapes of the requests the workers have upstream on backend ``identity`` of ``model`` now (the
        suspects when its engine froze), from a sync round; those of workers that did not answer in time are missed."""
        self._upstream[(model, identity)] = []
        try:
            await self._sync_round(timeout_s, (model, identity))
            return self._upstream[(model, identity)]
        finally:
            del self._upstream[(model, identity)]

    async def _sync_round(self, timeout_s: float, upstream_on: tuple[str, str] | None) -> bool:
        self.publish()
        self._sync += 1
        target = self._sync
        for worker in self.workers:
            self._send(worker, ("sync", target, upstream_on))
        deadline = time.monotonic() + timeout_s
        while True:
            pending = [w for w in self.workers if w.writer is not None and w.synced < target]
            if not pending:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)

    def in_flight(self, model: str, identity: str) -> int:
        return sum(worker.in_flight.get((model, identity), 0) for worker in self.workers if worker.writer is not None)

    def report(self) -> list[dict[str, Any]]:
        """Each worker, for the admin API."""
        return [
            {
                "index": w.index, "pid": w.proc.pid if w.proc else None,
                "running": w.proc is not None and w.proc.poll() is None, "connected": w.writer is not None,
                "routing_version": w.applied, "restarts": w.restarts,
                "in_flight": sum(w.in_flight.values()),
            }
            for w in self.workers
        ]  # fmt: skip

    # ------------------------------------------------------------------ reports, in
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One worker's end of the channel: its hello, then its reports until it goes."""
        worker: _Worker | None = None
        try:
            kind, index, pid = await channel.receive(reader)
            worker = self.workers[index] if kind == "hello" and 0 <= index < self.count else None
            if worker is None or worker.proc is None or worker.proc.pid != pid:
                writer.close()
                return
            worker.writer = writer
            self._send(worker, ("state", self.version, self._sent))
            if self._quotas_sent is not None:
                self._send(worker, ("quota", 0, self._quotas_sent))
            if self._drain_sent:
                self._send(worker, ("drain", 0, None))
            while True:
                message = await channel.receive(reader)
                if message[0] == "listening":
                    worker.listening.set()
                elif message[0] == "rows" and self.state.ledger is not None:  # rows of requests the worker answered
                    for row in message[1]:
                        self.state.ledger.record(row)
                elif message[0] == "report":
                    _, applied, synced, in_flight, lost, upstream, usage = message
                    if usage is not None:
                        self.quotas.absorb(worker.index, *usage, self.keys.policy.limited)
                    worker.applied, worker.synced, worker.in_flight = applied, synced, in_flight
                    self._note_lost(lost)
                    for model, identity, shape in upstream:
                        if (model, identity) in self._upstream:
                            self._upstream[(model, identity)].append(shape)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if worker is not None and worker.writer is writer:
                worker.writer = None
            writer.close()

    def _note_lost(self, lost: list[tuple[str, str, Suspicion]]) -> None:
        """Shapes of requests whose upstream connection broke in a worker: the watchdog's suspects, as if here."""
        for model, identity, shape in lost:
            route = self.state.registry.route(model)
            backend = route.backend_named(identity) if route is not None else None
            if backend is not None:
                backend.lost.append(shape)
