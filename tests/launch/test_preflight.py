"""Preflight checks: each failure says what is wrong and what to do."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from launch.config import EngineConfig
from launch.preflight import PreflightError, find_cuda_home, preflight, require


def local_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def messages(result) -> str:
    return "\n".join(f"{f.level}: {f.message}" for f in result.findings)


def test_local_cpu_model_passes(tmp_path: Path) -> None:
    result = preflight(EngineConfig(model_path=str(local_model(tmp_path)), device="cpu"))
    assert result.ok, messages(result)
    assert require(result, "m") == result.engine


def test_missing_local_path_fails(tmp_path: Path) -> None:
    result = preflight(EngineConfig(model_path=str(tmp_path / "absent"), device="cpu"))
    assert not result.ok
    assert "no such directory, and not a Hugging Face id" in messages(result)
    with pytest.raises(PreflightError, match=r"^model m: model_path .*absent: no such directory"):
        require(result, "m")


def test_directory_without_config_fails(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = preflight(EngineConfig(model_path=str(tmp_path / "empty"), device="cpu"))
    assert "no config.json" in messages(result) and not result.ok


def test_hf_id_is_accepted_with_a_note() -> None:
    result = preflight(EngineConfig(model_path="Qwen/Qwen2.5-7B-Instruct", device="cpu"))
    assert result.ok and "Hugging Face Hub" in messages(result)


def test_port_in_use_fails(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = preflight(EngineConfig(model_path=str(local_model(tmp_path)), device="cpu", port=port))
    assert not result.ok and f"port {port} on 127.0.0.1 is already in use" in messages(result)


def test_cuda_without_gpu_fails(tmp_path: Path) -> None:
    result = preflight(EngineConfig(model_path=str(local_model(tmp_path))), gpu_count=0, cuda_home="/usr/local/cuda")
    assert not result.ok and "no NVIDIA GPU is visible" in messages(result)


def test_tp_larger_than_gpus_fails(tmp_path: Path) -> None:
    engine = EngineConfig(model_path=str(local_model(tmp_path)), tp_size=4, dp_size=2)
    result = preflight(engine, gpu_count=4, cuda_home="/usr/local/cuda")
    assert "tp_size x dp_size = 8 GPUs needed, 4 visible" in messages(result)
    assert preflight(engine.model_copy(update={"dp_size": 1}), gpu_count=4, cuda_home="/usr/local/cuda").ok


def test_missing_cuda_home_turns_graphs_off_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_HOME", raising=False)
    engine = EngineConfig(model_path=str(local_model(tmp_path)), cuda_graph_max_bs=16)
    result = preflight(engine, gpu_count=1, cuda_home="")
    assert result.ok
    assert result.engine.cuda_graph_enabled is False and result.engine.cuda_graph_max_bs is None
    assert "CUDA graphs are turned off" in messages(result)


def test_found_cuda_home_is_passed_to_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_HOME", raising=False)
    result = preflight(EngineConfig(model_path=str(local_model(tmp_path))), gpu_count=1, cuda_home="/opt/cuda-13")
    assert result.engine.env["CUDA_HOME"] == "/opt/cuda-13" and result.engine.cuda_graph_enabled


def test_find_cuda_home_in_pip_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    toolkit = tmp_path / "site" / "nvidia" / "cuda_nvcc"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("")
    assert find_cuda_home([str(tmp_path / "site" / "nvidia" / "cu*")]) == str(toolkit)
    assert find_cuda_home([str(tmp_path / "none")]) is None


def test_missing_python_fails(tmp_path: Path) -> None:
    result = preflight(EngineConfig(model_path=str(local_model(tmp_path)), device="cpu", python="/no/such/python"))
    assert "python /no/such/python: no such executable" in messages(result)


MIB = 1 << 20


def test_tiny_dev_shm_with_tp_turns_nccl_shm_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_SHM_DISABLE", raising=False)
    engine = EngineConfig(model_path=str(local_model(tmp_path)), tp_size=2)
    result = preflight(engine, gpu_count=2, cuda_home="/opt/cuda", shm_bytes=64 * MIB)
    assert result.ok and result.engine.env["NCCL_SHM_DISABLE"] == "1"
    assert "/dev/shm is 64 MiB and tp_size is 2" in messages(result) and "--shm-size=1g" in messages(result)


def test_small_dev_shm_only_warns_and_a_users_setting_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_SHM_DISABLE", raising=False)
    engine = EngineConfig(model_path=str(local_model(tmp_path)), tp_size=2)
    result = preflight(engine, gpu_count=2, cuda_home="/opt/cuda", shm_bytes=768 * MIB)
    assert "NCCL_SHM_DISABLE" not in result.engine.env and "warning: /dev/shm is 768 MiB" in messages(result)
    mine = engine.model_copy(update={"env": {"NCCL_SHM_DISABLE": "0"}})
    result = preflight(mine, gpu_count=2, cuda_home="/opt/cuda", shm_bytes=64 * MIB)
    assert result.engine.env["NCCL_SHM_DISABLE"] == "0" and "warning: /dev/shm is 64 MiB" in messages(result)


@pytest.mark.parametrize("tp_size, shm_mib", [(1, 64), (2, 2048)])
def test_dev_shm_is_fine_for_one_gpu_or_when_large(tmp_path: Path, tp_size: int, shm_mib: int) -> None:
    engine = EngineConfig(model_path=str(local_model(tmp_path)), tp_size=tp_size)
    result = preflight(engine, gpu_count=2, cuda_home="/opt/cuda", shm_bytes=shm_mib * MIB)
    assert "/dev/shm" not in messages(result) and "NCCL_SHM_DISABLE" not in result.engine.env
