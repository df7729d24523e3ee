"""``sglang-gateway doctor`` run as a user runs it (subprocess): the embedded default's real CPU engine started, its
phases timed, two requests, a verdict, and the JSON report valid against the schema the host tests define; bad
input answered in one line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest

from tests.launch.test_doctor_host import REPORT_SCHEMA
from tests.servers import CLI, REPO


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
                          env={**os.environ, "COLUMNS": "160"})  # fmt: skip


@pytest.mark.usefixtures("starts_engine")
def test_doctor_starts_the_tiny_engine_times_it_and_writes_a_valid_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "doctor.json"
    done = run_cli("doctor", "configs/tiny-cpu.yaml", "--json", str(report_path))
    assert done.returncode in (0, 1), done.stderr[-2000:]
    report = json.loads(report_path.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    (run,) = report["engines"]
    assert run["error"] is None and run["model"] == "tiny" and run["cuda_graph"] is False
    for phase in ("loading weights", "weights loaded", "allocating KV cache", "HTTP server up", "ready"):
        assert phase in run["phases"], run["phases"]
    assert run["phases"]["loading weights"] <= run["phases"]["ready"] <= run["ready_s"]
    assert run["long_tokens"] == 64 and run["tokens_per_s"] > 0 and run["one_token_ms"] > 0
    command = run["command"]
    assert command[1:3] == ["-m", "sglang.launch_server"] and command[command.index("--device") + 1] == "cpu"
    (engine_check,) = [c for c in report["checks"] if c["name"] == "engine tiny (cpu)"]
    assert engine_check["level"] == "ok" and "tokens/s" in engine_check["detail"]
    assert report["verdict"] != "error" and done.returncode == 0
    assert "engine tiny (CUDA graphs off):" in done.stdout and "ready" in done.stdout  # the table and the phases


def test_doctor_names_a_bad_config_or_model_in_one_line(tmp_path: Path) -> None:
    missing = run_cli("doctor", str(tmp_path / "none.yaml"), "--no-engine")
    assert missing.returncode == 2 and "none.yaml" in missing.stderr and "Traceback" not in missing.stderr
    unknown = run_cli("doctor", "configs/tiny-cpu.yaml", "--no-engine", "--model", "nope")
    assert unknown.returncode == 2 and "nope" in unknown.stderr and "Traceback" not in unknown.stderr
    host_only = run_cli("doctor", "--no-engine")
    assert host_only.returncode == 0 and "python" in host_only.stdout
