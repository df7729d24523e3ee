"""`sglang-gateway check` and `launch`, run as a user runs them (subprocess, real engine)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from launch.shm import group_pids

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "gateway.cli"]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=REPO, env=env, check=False)


def test_check_prints_the_exact_command_line(tiny_model_dir: Path) -> None:
    env = {**os.environ, "SGLANG_GATEWAY_TINY_MODEL": str(tiny_model_dir)}
    result = run_cli("check", "configs/tiny-cpu.yaml", env=env)
    assert result.returncode == 0, result.stderr
    command = [line for line in result.stdout.splitlines() if "sglang.launch_server" in line]
    assert len(command) == 1
    assert "SGLANG_USE_CPU_ENGINE=1" in command[0]
    assert f"--model-path {tiny_model_dir}" in command[0] and "--served-model-name tiny" in command[0]


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("models:\n  m:\n    engine:\n      model_path: org/m\n      tp_size: 0\n", r"models\.m\.engine\.tp_size: Input should be greater than or equal to 1"),
        ("models:\n  m:\n    engine:\n      model_path: /nope/model\n      device: cpu\n", r"model m: model_path /nope/model: no such directory"),
        ("models:\n  m:\n    engine:\n      model_path: org/m\n      device: cpu\n      typo_key: 1\n", r"models\.m\.engine\.typo_key: unknown key"),
    ],
)
def test_check_rejects_bad_configs_in_one_line(tmp_path: Path, yaml_text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    result = run_cli("check", str(path))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert re.search(expected, errors[0]), errors[0]
    assert "Traceback" not in result.stderr


def test_launch_unknown_model_and_missing_file(tmp_path: Path) -> None:
    missing = run_cli("launch", str(tmp_path / "absent.yaml"))
    assert missing.returncode == 2 and "absent.yaml: no such file" in missing.stderr
    assert "Traceback" not in missing.stderr
    unknown = run_cli("launch", "configs/qwen2.5-7b-instruct.yaml", "--model", "nope")
    assert unknown.returncode == 2 and "no model named 'nope'" in unknown.stderr


@pytest.mark.engine
def test_launch_runs_until_ctrl_c_and_leaves_nothing(tiny_model_dir: Path) -> None:
    env = {**os.environ, "SGLANG_GATEWAY_TINY_MODEL": str(tiny_model_dir), "COLUMNS": "300"}
    proc = subprocess.Popen(
        [*CLI, "launch", "configs/tiny-cpu.yaml"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        ready = None
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            ready = re.search(r"engine tiny \(pid (\d+)\) ready at (http://\S+)", line)
            if ready:
                break
        assert ready, "".join(lines[-30:])
        pid, url = int(ready.group(1)), ready.group(2)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert group_pids(pid) == set(), "the engine outlived the CLI"


def test_check_validates_the_gateway_section_of_a_deployment_of_url_models(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("models:\n  big:\n    url: http://router.internal:30000\ngateway:\n  api_keys_env: CHECK_TEST_KEYS\n")
    missing = run_cli("check", str(path), env={k: v for k, v in os.environ.items() if k != "CHECK_TEST_KEYS"})
    assert missing.returncode == 2 and "gateway.api_keys_env: environment variable CHECK_TEST_KEYS is not set" in missing.stderr
    fine = run_cli("check", str(path), env={**os.environ, "CHECK_TEST_KEYS": "k1,k2"})
    assert fine.returncode == 0, fine.stderr
    assert "# big: external engine at http://router.internal:30000" in fine.stdout
    path.write_text("models:\n  big:\n    url: http://router.internal:30000\ngateway:\n  prot: 1\n")
    typo = run_cli("check", str(path))
    assert typo.returncode == 2 and "gateway.prot: unknown key" in typo.stderr and "Traceback" not in typo.stderr
