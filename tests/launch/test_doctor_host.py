"""The doctor's host checks against recorded GPU hosts: FAKE ``nvidia-smi`` and ``nvcc`` programs on ``PATH`` print
what the real ones printed (tests/launch/data/nvidia-smi: one recorded on an H200, the others its shape with another
driver's header), and the known failures of GPU hosts each produce their documented message and fix.

``read_host`` runs the real subprocess calls against those programs; limits, ``/dev/shm`` and the environment of a
serving container are set on the facts it returned, as a container would have them.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from launch.config import EngineConfig
from launch.doctor import diagnose
from launch.doctor.checks import Check, host_checks, overall
from launch.doctor.host import Gpu, HostFacts, read_host
from launch.doctor.pinned import pinned_stack_checks
from launch.gpu_profiles import select_profile

RECORDED = Path(__file__).parent / "data" / "nvidia-smi"
CU130 = select_profile("sglang-0.5.23-cu130")
CU128 = select_profile("sglang-0.5.10.post1-cu128")
GPU_ENGINE = EngineConfig(model_path="org/m", device="cuda", tp_size=2)
MIB = 1 << 20


def _program(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def fake_gpu_host(directory: Path, header: str, query: str, apps: str = "", nvcc_release: str | None = None) -> Path:
    """A directory of FAKE ``nvidia-smi`` (the recorded outputs, by argument) and, optionally, ``nvcc``."""
    (directory / "header.txt").write_text(header)
    (directory / "query.csv").write_text(query)
    (directory / "apps.csv").write_text(apps)
    _program(
        directory, "nvidia-smi",
        f'case "$1" in\n  --query-gpu=*) cat {directory}/query.csv;;\n  --query-compute-apps=*) cat {directory}/apps.csv;;\n'
        f"  *) cat {directory}/header.txt;;\nesac\n",
    )  # fmt: skip
    if nvcc_release:
        _program(directory, "nvcc", f'echo "Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.1"\n')
    return directory


def _query(driver: str, name: str = "NVIDIA A10G", capability: str = "8.6", total: int = 23028, free: int = 22000) -> str:
    return f"0, {name}, {capability}, {total}, {free}, {driver}\n"


@pytest.fixture
def host_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Put a fake GPU host's programs first on PATH; CUDA_HOME unset unless a test sets it."""

    def install(recorded: str, query: str, apps: str = "", nvcc_release: str | None = None) -> HostFacts:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        fake_gpu_host(bin_dir, (RECORDED / recorded).read_text(), query, apps, nvcc_release)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_HOME", raising=False)
        return read_host(sys.executable)

    return install


def _installed(facts: HostFacts, profile) -> HostFacts:
    """The facts of the same host with ``profile``'s stack installed for the engine's python."""
    stack = {"sglang": profile.sglang, "torch": profile.torch, "sglang-kernel": profile.sglang_kernel, "flashinfer-python": profile.flashinfer}
    return replace(facts, stack=stack)


def _by_name(checks: list[Check], name: str) -> Check:
    (check,) = [c for c in checks if c.name == name]
    return check


def test_the_recorded_h200_reads_and_passes(host_path) -> None:
    facts = host_path("h200-r580-cuda13.0.txt", (RECORDED / "h200-r580-query-gpu.csv").read_text(), nvcc_release="13.0")
    assert facts.nvidia_smi and facts.driver_version == "580.159.04" and facts.driver_cuda == "13.0"
    assert facts.gpus == [Gpu(0, "NVIDIA H200", "9.0", 143771, 143156)]
    assert facts.nvcc_cuda == "13.0" and facts.cuda_home is not None
    checks = host_checks(_installed(facts, CU130), [GPU_ENGINE.model_copy(update={"tp_size": 1})])
    assert _by_name(checks, "driver").level == "ok" and "runs natively" in _by_name(checks, "driver").detail
    assert _by_name(checks, "gpu 0").level == "ok" and "NVIDIA H200, compute capability 9.0, 140 of 140 GiB free" in _by_name(checks, "gpu 0").detail
    assert _by_name(checks, "cuda toolkit").level == "ok"


def test_a_driver_too_old_for_the_installed_wheels_names_the_profile_that_runs(host_path) -> None:
    facts = host_path("a10g-r550-cuda12.4.txt", _query("550.54.15"))
    driver = _by_name(host_checks(_installed(facts, CU130), [GPU_ENGINE]), "driver")
    assert driver.level == "error"
    assert f"profile {CU128.name} runs on it" in driver.detail and driver.fix == f"install profile {CU128.name}"
    compat = _by_name(host_checks(_installed(facts, CU128), [GPU_ENGINE]), "driver")
    assert compat.level == "warning" and "minor-version compatibility" in compat.detail
    assert compat.fix == f"upgrade the driver to >= {CU128.min_driver}"


def test_an_old_535_driver_and_an_11x_driver(host_path, tmp_path: Path) -> None:
    facts = host_path("v100-r470-cuda11.4.txt", _query("470.256.02", "Tesla V100-SXM2-16GB", "7.0"))
    checks = host_checks(_installed(facts, CU130), [GPU_ENGINE])
    assert _by_name(checks, "driver").level == "error" and "the driver supports CUDA 11.4: no profile runs on it" in _by_name(checks, "driver").detail
    bare = host_checks(replace(facts, stack={}), [GPU_ENGINE])  # nothing installed yet: what would run here
    assert _by_name(bare, "driver").detail == "driver 470.256.02 (CUDA 11.4): no GPU stack profile runs on it"
    assert _by_name(checks, "gpu 0").level == "error" and "older than Turing" in _by_name(checks, "gpu 0").detail


def test_cuda_home_unset_and_no_nvcc_is_named_with_its_consequences(host_path) -> None:
    facts = host_path("l40s-r570-cuda12.8.txt", _query("570.86.10", "NVIDIA L40S", "8.9"))
    facts = replace(facts, cuda_home=None, nvcc_cuda=None)  # a serving container: no toolkit
    toolkit = _by_name(host_checks(_installed(facts, CU128), [GPU_ENGINE]), "cuda toolkit")
    assert toolkit.level == "warning" and "FlashInfer kernels missing from its JIT cache cannot be built" in toolkit.detail
    assert "CUDA graphs off" in toolkit.detail and "set CUDA_HOME" in toolkit.fix


def test_an_nvcc_newer_than_the_driver(host_path) -> None:
    facts = host_path("a10g-r550-cuda12.4.txt", _query("550.54.15"), nvcc_release="12.8")
    toolkit = _by_name(host_checks(_installed(facts, CU128), [GPU_ENGINE]), "cuda toolkit")
    assert toolkit.level == "warning" and "newer than the driver's CUDA 12.4" in toolkit.detail


@pytest.mark.parametrize(("shm_mib", "level"), [(64, "error"), (700, "warning"), (2048, "ok")])
def test_dev_shm_sizes(host_path, shm_mib: int, level: str) -> None:
    facts = replace(host_path("h200-r580-cuda13.0.txt", _query("580.159.04", "NVIDIA H200", "9.0")), shm_bytes=shm_mib * MIB)
    shm = _by_name(host_checks(facts, [GPU_ENGINE]), "/dev/shm")
    assert shm.level == level
    if level != "ok":
        assert "NCCL needs shared memory" in shm.detail and "--shm-size=1g" in shm.fix


def test_limits_processes_holding_memory_and_a_databricks_container(host_path) -> None:
    facts = host_path(
        "h200-r580-cuda13.0.txt", _query("580.159.04", "NVIDIA H200", "9.0", 143771, 80000), apps="4242, python3, 63000\n"
    )
    assert facts.gpu_processes == [{"pid": 4242, "name": "python3", "used_mib": 63000}]
    facts = replace(_installed(facts, CU130), open_files=(1024, 4096), locked_memory=(64 << 10, 64 << 10),
                    container_env=["DATABRICKS_RUNTIME_VERSION", "DB_IS_DRIVER"], cgroup_memory_max="34359738368")  # fmt: skip
    checks = host_checks(facts, [GPU_ENGINE.model_copy(update={"tp_size": 1})])
    assert _by_name(checks, "gpu memory").level == "warning" and "pid 4242 python3 63000 MiB" in _by_name(checks, "gpu memory").detail
    assert _by_name(checks, "open files").fix == "ulimit -n 65536 (raise the hard limit first)"
    assert _by_name(checks, "locked memory").level == "warning" and "memlock=-1" in _by_name(checks, "locked memory").fix
    container = _by_name(checks, "container")
    assert "Databricks (environment variables DATABRICKS_RUNTIME_VERSION, DB_IS_DRIVER)" in container.detail
    assert "cgroup memory.max 34359738368" in container.detail
    assert overall(checks) == "warning"
    assert _by_name(host_checks(facts, [GPU_ENGINE]), "gpus").detail == "the deployment needs 2 GPUs per engine, 1 visible"


def test_a_logged_model_s_pinned_stack_against_the_host(host_path) -> None:
    facts = host_path("a10g-r550-cuda12.4.txt", _query("550.54.15"))
    pinned = pinned_stack_checks(CU130.requirements(), facts)
    assert pinned == [Check(
        "pinned stack", "error",
        f"the logged model pins GPU stack {CU130.name}: GPU stack {CU130.name} needs CUDA 13.x (NVIDIA driver >= "
        f"580.65.06), the driver supports CUDA 12.4: profile {CU128.name} runs on it, or upgrade the driver to >= 580.65.06",
        f"log it again with profile='{CU128.name}' (or driver='12.4')",
    )]  # fmt: skip
    assert pinned_stack_checks(CU128.requirements(), facts)[0].level == "warning"
    assert pinned_stack_checks(["mlflow==3.17.2", "sglang==0.5.23"], facts)[0].detail.endswith("a CPU engine")


# The JSON report's shape, for those who read it (docs/doctor.md).
REPORT_SCHEMA = {
    "type": "object",
    "required": ["report_version", "verdict", "host", "checks", "engines", "machine"],
    "properties": {
        "report_version": {"const": 1},
        "verdict": {"enum": ["ok", "warning", "error"]},
        "host": {"type": "object", "required": ["os", "python", "glibc", "stack", "driver_version", "driver_cuda", "gpus",
                                                "shm_bytes", "open_files", "container_env"]},  # fmt: skip
        "checks": {"type": "array", "items": {
            "type": "object", "required": ["name", "level", "detail", "fix"], "additionalProperties": False,
            "properties": {"level": {"enum": ["ok", "info", "warning", "error"]}, "name": {"type": "string"},
                           "detail": {"type": "string"}, "fix": {"type": "string"}}}},  # fmt: skip
        "engines": {"type": "array", "items": {
            "type": "object",
            "required": ["model", "cuda_graph", "command", "phases", "ready_s", "one_token_ms", "long_tokens", "tokens_per_s", "error"],
            "properties": {"phases": {"type": "object", "additionalProperties": {"type": "number"}},
                           "command": {"type": "array", "items": {"type": "string"}}}}},  # fmt: skip
    },
}


def test_the_host_report_without_engines_matches_its_schema_and_carries_no_environment_values(
    host_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_path("h200-r580-cuda13.0.txt", (RECORDED / "h200-r580-query-gpu.csv").read_text())
    monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-secret-value")
    report = diagnose(None, engine=False)
    jsonschema.validate(report, REPORT_SCHEMA)
    text = json.dumps(report)
    assert "DATABRICKS_TOKEN" in text and "dapi-secret-value" not in text
    assert report["host"]["gpus"][0]["name"] == "NVIDIA H200"


def test_the_report_recorded_on_a_real_h200_matches_the_schema() -> None:
    """What the doctor said on a real H200 host (no SGLang there, another process holding GPU memory)."""
    report = json.loads((RECORDED.parent / "doctor-h200.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    levels = {check["name"]: check["level"] for check in report["checks"]}
    assert levels["driver"] == "ok" and levels["gpu 0"] == "ok" and levels["gpu memory"] == "warning"
    assert levels["gpu stack"] == "error" and report["verdict"] == "error"
    assert report["host"]["driver_version"] == "580.159.04" and report["host"]["nvcc_cuda"] == "13.0"


@pytest.mark.parametrize(
    ("tail", "fix"),
    [
        (["RuntimeError: Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't exist"], "set CUDA_HOME"),
        (["Capture cuda graph failed: CUDA error: out of memory"], "lower cuda_graph_max_bs"),
        (["NCCL WARN Error: failed to extend /dev/shm/nccl-x to 9637892 bytes"], "/dev/shm of >= 1 GiB"),
        (["RuntimeError: CUDA driver version is insufficient for CUDA runtime version"], "driver is too old"),
        (["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"], "lower mem_fraction_static"),
        (["ValueError: something else"], "read the engine log"),
    ],
)
def test_a_failed_engine_start_gets_the_fix_its_log_points_to(tail: list[str], fix: str) -> None:
    from launch.doctor.engine_probe import fix_for

    assert fix in fix_for(tail)


def test_databricks_model_serving_is_recognised_by_the_variable_mlflow_reads(host_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IS_IN_DB_MODEL_SERVING_ENV", "true")
    facts = host_path("h200-r580-cuda13.0.txt", (RECORDED / "h200-r580-query-gpu.csv").read_text())
    assert "IS_IN_DB_MODEL_SERVING_ENV" in facts.container_env
    assert _by_name(host_checks(facts), "container").detail.startswith("Databricks Model Serving")


def test_a_hung_nvidia_smi_is_killed_with_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FAKE ``nvidia-smi`` that starts a child and hangs (a wedged driver): the doctor gives up
    on it after its timeout and leaves neither of them running."""
    from launch.doctor.host import run
    from launch.procgroup import pid_alive
    from tests.waiting import wait_until

    pids = tmp_path / "pids"
    _program(tmp_path, "nvidia-smi", f"sleep 300 &\necho $! > {pids}\nexec sleep 300\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    try:
        assert run(["nvidia-smi"], timeout_s=1) is None
        child = int(pids.read_text())
        wait_until(lambda: not pid_alive(child) or _zombie(child), f"the child {child} of the hung nvidia-smi to go", 10)
    finally:  # (what a failure left: this test's own child, by its pid)
        if pids.exists() and pid_alive(int(pids.read_text())) and not _zombie(int(pids.read_text())):
            os.kill(int(pids.read_text()), 9)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
