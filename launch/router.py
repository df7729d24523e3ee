"""SGLang's router (PyPI ``sglang-router``) as a supervised child process in front of a model's replicas.

Started like an engine: its own process group and parent-death signal, its output in a log file, bound to
loopback (its Prometheus port too), with the replicas' local tokenizer and no hub access, and the
replicas' shared API key handed over through a private file (see :mod:`launch.router_main`). Its worker
list follows the replicas at run time through the router's own API (``POST /workers``,
``DELETE /workers/{id}``), so a restarted or swapped replica never needs a router restart.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from loguru import logger

from launch.argv import ROUTER_ENV, ROUTER_MODULE, router_args
from launch.config import RouterConfig
from launch.logpump import pump_output
from launch.ports import pick_free_port
from launch.process import LOG_TAIL_LINES, EngineExited, EngineStartTimeout, bearer
from launch.procgroup import popen_group, stop_group


class RouterProcess:
    """One ``sglang_router`` process for one model."""

    def __init__(self, name: str, config: RouterConfig, *, tokenizer_path: str, api_key: str | None, log_dir: str | Path | None = None) -> None:
        self.name = name
        self.config = config
        self.tokenizer_path = tokenizer_path
        self.api_key = api_key
        self._log_dir = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "sglang-gateway-logs"
        self._proc: subprocess.Popen[bytes] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._reader: threading.Thread | None = None
        self.port = 0
        self.metrics_port = 0
        self.log_file: Path | None = None
        self.started_at: float | None = None
        self._first_workers: list[str] | None = None  # added through the API once the router answers

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def log_tail(self, lines: int = 40) -> list[str]:
        return list(self._tail)[-lines:]

    def start(self, worker_urls: list[str]) -> None:
        """Spawn the router in front of ``worker_urls`` (returns at once; see :meth:`wait_ready`)."""
        self.port, self.metrics_port = pick_free_port(), pick_free_port()
        # Workers named by --worker-urls get no API key from the router (0.3.2): each is added through its
        # API instead (sync_workers), with the engines' key, once the router answers.
        self._first_workers = list(worker_urls)
        argv = router_args(self.config, port=self.port, metrics_port=self.metrics_port, worker_urls=[], tokenizer_path=self.tokenizer_path)
        fd, secret = tempfile.mkstemp(prefix=f"sglang-gateway-router-{self.name}-", suffix=".json")  # mode 0600
        with os.fdopen(fd, "w") as handle:
            json.dump({"argv": argv, "api_key": self.api_key}, handle)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.log_file = self._log_dir / f"router-{self.name}-{self.port}-{int(time.time())}.log"
        logger.info("router {}: starting on port {} in front of {}", self.name, self.port, ", ".join(worker_urls) or "no worker yet")
        self._proc = popen_group(
            [self.config.python_executable, "-m", ROUTER_MODULE, secret],
            env={**os.environ, **ROUTER_ENV},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.started_at = time.monotonic()
        self._reader = threading.Thread(target=self._pump_log, name=f"router-log-{self.name}", daemon=True)
        self._reader.start()

    def wait_ready(
        self, worker_urls: list[str] = (), timeout_s: float | None = None, stop_when: Callable[[], bool] | None = None  # type: ignore[assignment]
    ) -> None:
        """Block until the router answers and counts every one of ``worker_urls`` as a healthy worker (it adds
        its first workers in the background); EngineExited / EngineStartTimeout otherwise."""
        assert self._proc is not None, "the router was not started"
        deadline = time.monotonic() + (self.config.startup_timeout_s if timeout_s is None else timeout_s)
        with httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0), trust_env=False) as client:
            while True:
                if self._proc.poll() is not None:
                    raise EngineExited(
                        f"router {self.name!r} exited with code {self._proc.returncode} while starting",
                        name=self.name, returncode=self._proc.returncode, log_tail=self.log_tail(LOG_TAIL_LINES), log_file=self.log_file,
                    )  # fmt: skip
                try:
                    alive = client.get(self.url + "/liveness").status_code == 200
                    if alive and self._first_workers is not None:
                        self.sync_workers(self._first_workers)
                        self._first_workers = None
                    if alive and self._healthy_workers(client) >= set(worker_urls):
                        logger.info("router {}: ready at {}", self.name, self.url)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline or (stop_when is not None and stop_when()):
                    self.stop()
                    raise EngineStartTimeout(
                        f"router {self.name!r} was not ready in time", name=self.name, returncode=None,
                        log_tail=self.log_tail(LOG_TAIL_LINES), log_file=self.log_file,
                    )  # fmt: skip
                time.sleep(0.2)

    def stop(self, grace_s: float = 10.0) -> None:
        proc = self._proc
        if proc is None:
            return
        stop_group(proc, grace_s, label=f"router {self.name}")
        if self._reader is not None:
            self._reader.join(timeout=5.0)

    # ------------------------------------------------------------------ its worker list
    def _auth(self) -> dict[str, str]:
        """The router's own API (``/workers``) takes the key it was started with, as the engines do."""
        return bearer(self.api_key)

    def workers(self, client: httpx.Client | None = None) -> dict[str, str]:
        """``{url: worker id}`` as the router knows them now."""
        response = (client or httpx).get(self.url + "/workers", headers=self._auth(), timeout=10.0)
        response.raise_for_status()
        return {worker["url"]: worker["id"] for worker in response.json().get("workers", [])}

    def _healthy_workers(self, client: httpx.Client) -> set[str]:
        response = client.get(self.url + "/workers", headers=self._auth())
        return {w["url"] for w in response.json().get("workers", []) if w.get("is_healthy")} if response.status_code == 200 else set()

    def sync_workers(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """Make the router's workers ``urls`` (added and removed in the background by the router); returns
        (added, removed)."""
        with httpx.Client(trust_env=False) as client:
            current = self.workers(client)
            added = [url for url in urls if url not in current]
            removed = [url for url in current if url not in urls]
            for url in added:
                body: dict[str, str] = {"url": url}
                if self.api_key:
                    body["api_key"] = self.api_key
                client.post(self.url + "/workers", json=body, headers=self._auth(), timeout=10.0).raise_for_status()
            for url in removed:
                client.delete(f"{self.url}/workers/{current[url]}", headers=self._auth(), timeout=10.0).raise_for_status()
        if added or removed:
            logger.info("router {}: workers + {} - {}", self.name, added or "none", removed or "none")
        return added, removed

    def _pump_log(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None and self.log_file is not None
        pump_output(self._proc.stdout, self.log_file, secret=self.api_key, on_line=self._tail.append)
