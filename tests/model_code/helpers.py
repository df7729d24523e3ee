"""Helpers of the model_code tests: engine processes of this test process, the last MLflow trace."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from launch.ports import pick_free_port
from launch.shm import group_pids


def engine_children(parent: int | None = None) -> list[int]:
    """Pids of ``sglang.launch_server`` processes whose parent is ``parent`` (default: this test process)."""
    me = os.getpid() if parent is None else parent
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        if ppid == me and b"sglang.launch_server" in cmdline:
            pids.append(int(entry.name))
    return pids


def group_alive(pgid: int) -> bool:
    return bool(group_pids(pgid))


def last_trace() -> Any:
    import mlflow

    mlflow.flush_trace_async_logging()
    trace_id = mlflow.get_last_active_trace_id()
    assert trace_id is not None
    return mlflow.get_trace(trace_id)


@contextmanager
def http_server_process(
    argv: list[str], *, log_path: Path, env: dict[str, str], ready_path: str = "/ping"
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run a server command (its ``--port``/``-p`` is picked here) in its own process group; yield (url, process).

    Waits until ``ready_path`` answers 200; stops the whole group at the end (SIGTERM, then SIGKILL).
    """
    port = pick_free_port()
    argv = [arg.replace("{port}", str(port)) for arg in argv]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{url}{ready_path}", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"{argv[:4]} did not answer {ready_path} in 180 s:\n{log_path.read_text()[-3000:]}")
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
