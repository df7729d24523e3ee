"""Helpers of the model_code tests: engine processes of this test process, the last MLflow trace."""

from __future__ import annotations

import os
from typing import Any

from launch.procgroup import child_pids, cmdline


def engine_children(parent: int | None = None) -> list[int]:
    """Pids of ``sglang.launch_server`` processes whose parent is ``parent`` (default: this test process)."""
    return [pid for pid in child_pids(os.getpid() if parent is None else parent) if "sglang.launch_server" in cmdline(pid)]


def last_trace() -> Any:
    import mlflow

    mlflow.flush_trace_async_logging()
    trace_id = mlflow.get_last_active_trace_id()
    assert trace_id is not None
    return mlflow.get_trace(trace_id)
