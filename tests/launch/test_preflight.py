"""Preflight checks: each failure says what is wrong and what to do."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from launch.config import EngineConfig
from launch.gpu_profiles import DEFAULT_PROFILE, installed_profile
from launch.model_checks import GpuFacts
from launch.preflight import (
    PreflightError,
    check_gpu_stack,
    find_cuda_home,
    installed_stack,
    parse_driver_cuda,
    parse_gpu_facts,
    preflight,
    require,
)
from launch.sglang_versions import installed_sglang


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
    assert preflight(
        engine.model_copy(update={"dp_size": 1}), gpu_count=4, cuda_home="/usr/local/cuda", driver_cuda=(13, 0)
    ).ok


def test_an_engine_spanning_machines_needs_its_share_of_gpus_here(tmp_path: Path) -> None:
    spread = EngineConfig(model_path=str(local_model(tmp_path)), tp_size=16, nnodes=2, dist_init_addr="head:5000")
    assert preflight(spread, gpu_count=8, cuda_home="/usr/local/cuda", driver_cuda=(13, 0)).ok
    result = preflight(spread, gpu_count=4, cuda_home="/usr/local/cuda", driver_cuda=(13, 0))
    assert "tp_size x dp_size / nnodes 2 = 8 GPUs needed, 4 visible" in messages(result)


def test_missing_cuda_home_turns_graphs_off_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_HOME", raising=False)
    engine = EngineConfig(model_path=str(local_model(tmp_path)), cuda_graph_max_bs=16)
    result = preflight(engine, gpu_count=1, cuda_home="", driver_cuda=(13, 0))
    assert result.ok
    assert result.engine.cuda_graph_enabled is False and result.engine.cuda_graph_max_bs is None
    assert "CUDA graphs are turned off" in messages(result)


def test_require_logs_what_it_adjusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving container without nvcc: the engine starts with CUDA graphs off, and the log says why."""
    from loguru import logger

    monkeypatch.delenv("CUDA_HOME", raising=False)
    engine = EngineConfig(model_path=str(local_model(tmp_path)))
    result = preflight(engine, gpu_count=1, cuda_home="", driver_cuda=(13, 0))
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{level} {message}")
    try:
        engine = require(result, "qwen")
    finally:
        logger.remove(sink)
    assert engine.cuda_graph_enabled is False
    warned = [line for line in lines if line.startswith("WARNING model qwen: CUDA_HOME is unset")]
    assert warned and "CUDA graphs are turned off" in warned[0], lines


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


# ---------------------------------------------------------------------------------- driver vs GPU stack
# Real `nvidia-smi` output published by users (header lines as printed, GPU rows cut): the header names
# the newest CUDA the driver supports ("CUDA Version" up to R580, "CUDA UMD Version" from R610 on).
SMI_R580 = """\
Mon Nov 24 12:53:00 2025
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: 13.0     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
"""
SMI_R610 = """\
Sun Jun  7 08:16:57 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 610.43.02              KMD Version: 610.43.02     CUDA UMD Version: 13.3     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|   0  NVIDIA B200                    On  |   00000000:63:00.0 Off |                    0 |
"""
SMI_R570 = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.172.08             Driver Version: 570.172.08     CUDA Version: 12.8     |
|-----------------------------------------+------------------------+----------------------+
"""
SMI_R450_OLD_LAYOUT = """\
Wed Jul 29 21:51:11 2020
+-----------------------------------------------------------------------------+
| NVIDIA-SMI 450.57       Driver Version: 450.57       CUDA Version: 11.0     |
|-------------------------------+----------------------+----------------------+
"""
SMI_QUERY = """\
==============NVSMI LOG==============

Timestamp                           : Thu Jan 16 14:17:10 2020
Driver Version                      : 440.44
CUDA Version                        : 10.2
"""
SMI_NO_CUDA = """\
| NVIDIA-SMI 575.64.03              Driver Version: 575.64.03      CUDA Version: N/A      |
"""


@pytest.mark.parametrize(
    "output, expected",
    [
        (SMI_R580, (13, 0)),
        (SMI_R610, (13, 3)),
        (SMI_R570, (12, 8)),
        (SMI_R450_OLD_LAYOUT, (11, 0)),
        (SMI_QUERY, (10, 2)),
        (SMI_NO_CUDA, None),
        ("", None),
    ],
)
def test_driver_cuda_version_is_read_from_nvidia_smi(output: str, expected) -> None:
    assert parse_driver_cuda(output) == expected


def _gpu_engine(tmp_path: Path) -> EngineConfig:
    return EngineConfig(model_path=str(local_model(tmp_path)), device="cuda")


def test_installed_stack_of_the_engine_python_is_a_profile(tmp_path: Path) -> None:
    """This environment holds the default profile's SGLang and torch (the CPU build installs the same versions)."""
    stack = installed_stack(sys.executable)
    assert stack is not None and installed_profile(*stack) == DEFAULT_PROFILE
    assert installed_stack(str(tmp_path / "no-python")) is None


@pytest.mark.parametrize("smi", [SMI_R580, SMI_R610])
def test_driver_new_enough_for_the_profile_passes(tmp_path: Path, smi: str) -> None:
    stack = (DEFAULT_PROFILE.sglang, DEFAULT_PROFILE.torch)
    assert check_gpu_stack(_gpu_engine(tmp_path), parse_driver_cuda(smi), stack) == []


def test_cuda_12_driver_is_refused_naming_the_driver_needed(tmp_path: Path) -> None:
    result = preflight(
        _gpu_engine(tmp_path), gpu_count=1, cuda_home="/opt/cuda", driver_cuda=parse_driver_cuda(SMI_R570)
    )
    assert not result.ok
    (error,) = result.errors
    assert error.message == (
        f"the NVIDIA driver supports CUDA 12.8 (SGLang {DEFAULT_PROFILE.sglang}, torch {DEFAULT_PROFILE.torch}): "
        f"GPU stack {DEFAULT_PROFILE.name} needs CUDA 13.x (NVIDIA driver >= 580.65.06), the driver supports CUDA "
        f"12.8: profile sglang-0.5.10.post1-cu128 runs on it, or upgrade the driver to >= {DEFAULT_PROFILE.min_driver}"
    )
    with pytest.raises(PreflightError, match=r"^model m: the NVIDIA driver supports CUDA 12\.8"):
        require(result, "m")


def test_unreadable_driver_version_warns_with_the_driver_needed(tmp_path: Path) -> None:
    stack = (DEFAULT_PROFILE.sglang, DEFAULT_PROFILE.torch)
    (finding,) = check_gpu_stack(_gpu_engine(tmp_path), parse_driver_cuda(SMI_NO_CUDA), stack)
    assert finding.level == "warning" and f"NVIDIA driver >= {DEFAULT_PROFILE.min_driver}" in finding.message


def test_stack_outside_the_table_and_missing_sglang(tmp_path: Path) -> None:
    engine = _gpu_engine(tmp_path)
    (unknown,) = check_gpu_stack(engine, (13, 0), ("0.5.19", "2.9.1+cu129"))
    assert unknown.level == "warning" and "SGLang 0.5.19 with torch 2.9.1+cu129 is no known GPU stack profile" in (
        unknown.message
    )
    assert DEFAULT_PROFILE.summary() in unknown.message
    (missing,) = check_gpu_stack(engine, (13, 0), ("", ""))
    assert missing.level == "error" and "SGLang is not installed" in missing.message
    cu130_torch = (DEFAULT_PROFILE.sglang, f"{DEFAULT_PROFILE.torch}+cu130")  # the PyTorch index's spelling
    assert check_gpu_stack(engine, (13, 0), cu130_torch) == []


def test_cpu_engine_skips_the_driver_check(tmp_path: Path) -> None:
    engine = EngineConfig(model_path=str(local_model(tmp_path)), device="cpu")
    assert check_gpu_stack(engine, (11, 0), ("", "")) == []
    assert preflight(engine, driver_cuda=(11, 0)).ok


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


# --------------------------------------------------------------- what the engine would fail on (launch.model_checks)


def weights_only_model(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """The tiny model's config and weights without its tokenizer files (a partly copied model)."""
    model = tmp_path / "weights-only"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).symlink_to(tiny_model_dir / name)
    return model


def test_a_model_with_weights_but_no_tokenizer_fails(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = weights_only_model(tmp_path, tiny_model_dir)
    result = preflight(EngineConfig(model_path=str(model), device="cpu"))
    assert not result.ok and f"model_path {model}: no tokenizer in this directory" in messages(result) and "set tokenizer_path" in messages(result)
    assert preflight(EngineConfig(model_path=str(model), tokenizer_path=str(tiny_model_dir), device="cpu")).ok
    assert preflight(EngineConfig(model_path=str(model), device="cpu", extra_args=["--skip-tokenizer-init"])).ok
    empty = tmp_path / "empty-tokenizer"
    empty.mkdir()
    result = preflight(EngineConfig(model_path=str(tiny_model_dir), tokenizer_path=str(empty), device="cpu"))
    assert f"error: tokenizer_path {empty}: no tokenizer in this directory" in messages(result)


def test_max_total_tokens_beyond_memory_warns_with_the_numbers(tiny_model_dir: Path) -> None:
    result = preflight(EngineConfig(model_path=str(tiny_model_dir), device="cpu", dtype="float32", max_total_tokens=10**9))
    assert result.ok  # SGLang starts with the tokens that fit: a warning, with what it will hold
    text = messages(result)
    # the tiny model: 2 full-attention layers x 2 KV heads x 32 dims x 4 bytes x (keys, values)
    assert "warning: max_total_tokens 1000000000: its KV cache takes about 954 GiB (1024 bytes a token), more than the" in text, text
    assert "GiB of RAM" in text and "lower it" in text
    assert not preflight(EngineConfig(model_path=str(tiny_model_dir), device="cpu", dtype="float32", max_total_tokens=4096)).findings
    gpu = GpuFacts((9, 0), 80 * 1024)  # on cuda: the memory of its tp_size GPUs
    fits = EngineConfig(model_path=str(tiny_model_dir), dtype="float16", max_total_tokens=80 * 2**30 // 512 - 1)
    assert not [f for f in preflight(fits, gpu_count=1, cuda_home="/x", driver_cuda=(13, 0), gpus=[gpu]).findings if f.level == "warning"]
    beyond = fits.model_copy(update={"max_total_tokens": 80 * 2**30 // 512 + 1})
    text = messages(preflight(beyond, gpu_count=1, cuda_home="/x", driver_cuda=(13, 0), gpus=[gpu]))
    assert "warning: max_total_tokens" in text and "memory of 1 GPU(s)" in text, text


def test_bfloat16_on_a_gpu_older_than_ampere_fails(tiny_model_dir: Path) -> None:
    engine = EngineConfig(model_path=str(tiny_model_dir), dtype="bfloat16")
    volta = preflight(engine, gpu_count=1, cuda_home="/x", driver_cuda=(13, 0), gpus=[GpuFacts((7, 0), 16384)])
    assert not volta.ok
    assert "error: dtype bfloat16: this GPU's compute capability is 7.0, and bfloat16 needs 8.0 (Ampere) or newer: use dtype: float16" in messages(volta)
    assert preflight(engine, gpu_count=1, cuda_home="/x", driver_cuda=(13, 0), gpus=[GpuFacts((8, 0), 40960)]).ok


def test_an_unknown_extra_flag_fails_naming_the_closest(tiny_model_dir: Path) -> None:
    engine = EngineConfig(model_path=str(tiny_model_dir), device="cpu", extra_args=["--max-runing-requests", "3"])
    result = preflight(engine)
    assert not result.ok
    version = installed_sglang(engine.python_executable)
    assert f"error: extra_args: --max-runing-requests: SGLang {version} has no such flag (did you mean --max-running-requests?)" in messages(result)
    for fine in (["--max-running-requests", "3"], ["--max-running-requests=3"], ["--max-running", "3"]):  # abbreviations: SGLang's parser takes them
        assert preflight(engine.model_copy(update={"extra_args": fine})).ok, fine


def test_gpu_facts_are_read_from_nvidia_smi_and_narrowed_to_the_visible_ones() -> None:
    listing = "0, 9.0, 81559\n1, 7.0, 16384\n2, [N/A], 1000\n"
    assert parse_gpu_facts(listing, None) == [GpuFacts((9, 0), 81559), GpuFacts((7, 0), 16384)]
    assert parse_gpu_facts(listing, "1") == [GpuFacts((7, 0), 16384)]
    assert parse_gpu_facts("", None) == []
