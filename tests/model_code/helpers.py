"""Helpers of the model_code tests: engine processes of this test process, the last MLflow trace."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def engine_children() -> list[int]:
    """Pids of ``sglang.launch_server`` processes whose parent is this test process."""
    me = os.getpid()
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
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def last_trace() -> Any:
    import mlflow

    mlflow.flush_trace_async_logging()
    trace_id = mlflow.get_last_active_trace_id()
    assert trace_id is not None
    return mlflow.get_trace(trace_id)
