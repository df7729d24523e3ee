"""``log_model`` starts no engine (MLflow loads and predicts at log time), pins the GPU stack profile
(FlashInfer by wheel URL), and records config, weights, LoRA adapters and task as asked."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
import pytest
import yaml

from launch.config import ConfigError
from launch.gpu_profiles import DEFAULT_PROFILE, UnknownGpuProfile
from model_code import engine_owner, log_model
from model_code.flavors.table import FLAVORS
from model_code.log import no_engine
from model_code.target import resolve_target
from tests.lora import make_adapter
from tests.model_code.helpers import engine_children

REPO = Path(__file__).resolve().parents[2]
QWEN_7B = REPO / "configs" / "qwen2.5-7b-instruct.yaml"


def _files(info) -> Path:
    return Path(mlflow.artifacts.download_artifacts(info.model_uri))


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_logging_a_managed_config_starts_no_engine(flavor, mlflow_store, tiny_deployment, tiny_model_dir):
    starts, children = engine_owner.STARTS, set(engine_children())
    with mlflow.start_run():
        info = log_model(REPO / "configs" / "tiny-cpu.yaml", flavor=flavor, model_path=tiny_model_dir)
    assert engine_owner.STARTS == starts and set(engine_children()) == children
    files = _files(info)
    assert (files / "artifacts" / tiny_model_dir.name / "config.json").is_file()  # weights logged
    for package in ("launch", "engine_guard", "model_code", "model_code/flavors"):
        assert (files / "code" / package / "__init__.py").is_file()  # code_paths
    code_file = FLAVORS[flavor].path.name  # the flavour's module is its models-from-code file, packed twice:
    assert (files / code_file).is_file() and (files / "code" / "model_code" / "flavors" / code_file).is_file()
    config = yaml.safe_load((files / "MLmodel").read_text())["flavors"]["python_function"]["config"]
    assert config["models"]["tiny"]["engine"]["device"] == "cpu"
    requirements = (files / "requirements.txt").read_text().splitlines()
    assert "sglang==0.5.23" in requirements and not any("flashinfer" in r for r in requirements)  # CPU target


def test_logging_a_7b_gpu_config_without_gpu(mlflow_store):
    """The qwen 7B GPU config logs on a machine without a GPU; the profile's pins and FlashInfer wheel URLs
    in requirements.txt."""
    starts, children = engine_owner.STARTS, set(engine_children())
    with mlflow.start_run():
        info = log_model(QWEN_7B, flavor="chat_agent", task="chat", profile=DEFAULT_PROFILE.name, python="3.11")
    assert engine_owner.STARTS == starts and set(engine_children()) == children
    files = _files(info)
    requirements = (files / "requirements.txt").read_text().splitlines()
    for line in DEFAULT_PROFILE.requirements():
        assert line in requirements
    assert (
        f"https://github.com/flashinfer-ai/flashinfer/releases/download/v{DEFAULT_PROFILE.flashinfer}/"
        f"flashinfer_jit_cache-{DEFAULT_PROFILE.flashinfer}+cu130-cp39-abi3-manylinux_2_28_x86_64.whl"
    ) in requirements
    assert not any("cu128" in line or "cu129" in line or line.startswith("--") for line in requirements)
    model = yaml.safe_load((files / "MLmodel").read_text())
    assert model["metadata"]["task"] == "llm/v1/chat"  # override for Databricks serving without the agents SDK
    assert (
        model["flavors"]["python_function"]["config"]["models"]["qwen2.5-7b-instruct"]["engine"]["model_path"]
        == "Qwen/Qwen2.5-7B-Instruct"
    )
    assert not (files / "artifacts").exists()  # no local weights: the engine loads model_path where it is served


def test_flashinfer_override_and_default_task(mlflow_store):
    url = "https://example.org/wheels/flashinfer_python-0.7.2-py3-none-any.whl"
    with mlflow.start_run():
        info = log_model(QWEN_7B, flavor="responses_agent", flashinfer=url)
    files = _files(info)
    assert url in (files / "requirements.txt").read_text().splitlines()
    assert yaml.safe_load((files / "MLmodel").read_text())["metadata"]["task"] == "agent/v1/responses"


def test_plain_mlflow_log_model_starts_no_engine(mlflow_store, tiny_engine_config, tiny_model_dir):
    """Without our helper: MLflow's own log_model on the models-from-code file is recognised too."""
    starts, children = engine_owner.STARTS, set(engine_children())
    with mlflow.start_run():
        mlflow.pyfunc.log_model(
            name="model",
            python_model=str(FLAVORS["chat_model"].path),
            model_config={
                "models": {"tiny": {"engine": tiny_engine_config.model_dump(mode="json", exclude_defaults=True)}}
            },
            artifacts={"llm-model": str(tiny_model_dir.resolve())},  # MLflow refuses a symlinked directory
            code_paths=[str(REPO / "launch"), str(REPO / "engine_guard"), str(REPO / "model_code")],
            pip_requirements=["sglang==0.5.23"],
        )
    assert engine_owner.STARTS == starts and set(engine_children()) == children


def test_bad_arguments(mlflow_store, tmp_path):
    with pytest.raises(ValueError, match="flavor must be one of"):
        log_model(QWEN_7B, flavor="chat")
    with pytest.raises(ConfigError, match="missing: not a local directory"):
        log_model(QWEN_7B, model_path=tmp_path / "missing")
    with pytest.raises(UnknownGpuProfile, match=r"^no GPU stack profile for CUDA 12\.4 .* Profiles: sglang-0\.5\.23-cu130 "):
        log_model(QWEN_7B, cuda="12.4")
    with pytest.raises(UnknownGpuProfile, match=r"^driver 535\.104\.05: GPU stack sglang-0\.5\.23-cu130 needs CUDA 13\.x"):
        log_model(QWEN_7B, profile="sglang-0.5.23-cu130", driver="535.104.05")


def test_a_pyfunc_model_packs_its_adapters_and_loads_them_from_its_artifacts(
    mlflow_store: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    source = make_adapter(tiny_model_dir, tmp_path / "adapter", 1)
    config = {"models": {"tiny": {"engine": {"model_path": str(tiny_model_dir), "device": "cpu"}, "adapters": {"support": str(source)}}}}
    with mlflow.start_run():
        info = log_model(config, flavor="chat_agent")
    files = Path(mlflow.artifacts.download_artifacts(info.model_uri))
    assert (files / "artifacts" / "lora-support" / "adapter_config.json").is_file()
    with no_engine():
        model_config = mlflow.pyfunc.load_model(info.model_uri).model_config
    target = resolve_target(model_config, {"lora-support": str(files / "artifacts" / "lora-support")})  # as load_context
    assert target.engine.lora_paths == {"support": str(files / "artifacts" / "lora-support")} and target.adapters == ("support",)
    with pytest.raises(FileNotFoundError, match="adapter broken: .* has no adapter_config.json"):
        (tmp_path / "empty").mkdir()
        log_model({**config, "models": {"tiny": {**config["models"]["tiny"], "adapters": {"broken": str(tmp_path / "empty")}}}})


def test_a_logged_model_whose_stack_the_host_driver_cannot_run_is_named_before_anything_starts(
    mlflow_store, tmp_path, monkeypatch
):
    """model_code.doctor(uri) on a host with a CUDA 12.4 driver (a FAKE nvidia-smi printing a recorded output): the
    CUDA 13 model is refused naming the CUDA 12 profile, the CUDA 12 model runs there (under compatibility)."""
    from model_code import doctor
    from tests.launch.test_doctor_host import RECORDED, _query, fake_gpu_host

    with mlflow.start_run():
        cu130 = log_model(QWEN_7B, profile="sglang-0.5.23-cu130", name="cu130")
        cu128 = log_model(QWEN_7B, driver="12.4", name="cu128")
    (tmp_path / "bin").mkdir()
    bin_dir = fake_gpu_host(tmp_path / "bin", (RECORDED / "a10g-r550-cuda12.4.txt").read_text(), _query("550.54.15"))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (refused,) = doctor(cu130.model_uri)
    assert refused["level"] == "error" and "pins GPU stack sglang-0.5.23-cu130" in refused["detail"]
    assert refused["fix"] == "log it again with profile='sglang-0.5.10.post1-cu128' (or driver='12.4')"
    (runs,) = doctor(cu128.model_uri)
    assert runs["level"] == "warning" and "minor-version compatibility" in runs["detail"]


def test_a_cuda_13_model_loaded_on_a_cuda_12_4_host_names_the_profile_that_runs_there(
    mlflow_store, tiny_model_dir, tmp_path, monkeypatch
):
    """The loaded model's engine preflight checks the installed stack (here the default profile, as in a serving image
    built from its requirements) against the host's driver, read from a FAKE ``nvidia-smi`` printing the recorded
    CUDA 12.4 driver's output (there is no GPU here), and says which profile runs there. No engine starts.
    (From the CUDA 12 profile helper's branch.)"""
    from tests.launch.test_doctor_host import RECORDED

    config = {"models": {"tiny": {"engine": {"model_path": str(tiny_model_dir), "device": "cuda"}}}}
    with mlflow.start_run():
        info = log_model(config, flavor="chat_agent", profile=DEFAULT_PROFILE.name, python="3.11")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA A10G (UUID: GPU-0)"; '
        f'else cat "{RECORDED / "a10g-r550-cuda12.4.txt"}"; fi\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    starts = engine_owner.STARTS
    with pytest.raises(Exception, match=r"the NVIDIA driver supports CUDA 12\.4 .*needs CUDA 13\.x") as refused:
        mlflow.pyfunc.load_model(info.model_uri)
    assert "profile sglang-0.5.10.post1-cu128 runs on it" in str(refused.value)
    assert engine_owner.STARTS == starts


def _hugging_face_snapshot(model_dir: Path, cache: Path) -> Path:
    """``model_dir`` laid out as a Hugging Face cache keeps it: ``snapshots/<revision>/<file> -> ../../blobs/<hash>``."""
    snapshot, blobs = cache / "snapshots" / "0123abcd", cache / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for number, source in enumerate(sorted(model_dir.iterdir())):
        assert source.is_file(), source  # the tiny model is flat
        (blobs / f"blob{number}").write_bytes(source.read_bytes())
        (snapshot / source.name).symlink_to(Path("..", "..", "blobs", f"blob{number}"))
    return snapshot


@pytest.mark.parametrize("flavor", ["chat_model", "entrypoint"])
def test_a_hugging_face_cache_snapshot_is_logged_with_its_files(flavor, mlflow_store, tiny_deployment, tiny_model_dir, tmp_path):
    """A snapshot's files are links out of its folder, which MLflow refuses ("resolved path is outside the artifact
    directory"): they are packed as files, under the snapshot's name, and nothing is left beside the snapshot."""
    snapshot = _hugging_face_snapshot(tiny_model_dir, tmp_path / "models--org--tiny")
    with mlflow.start_run():
        info = log_model(REPO / "configs" / "tiny-cpu.yaml", flavor=flavor, model_path=snapshot)
    packed = _files(info) / "artifacts" / snapshot.name
    names = sorted(path.name for path in tiny_model_dir.iterdir())
    assert sorted(path.name for path in packed.iterdir()) == names
    for name in names:
        assert not (packed / name).is_symlink() and (packed / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    assert [path.name for path in snapshot.parent.iterdir()] == [snapshot.name]  # the mirror is gone
    assert all((snapshot / name).is_symlink() for name in names)  # the snapshot is as it was
