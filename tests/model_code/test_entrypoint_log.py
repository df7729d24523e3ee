"""``log_model(flavor="entrypoint")``: what Databricks custom LLM serving reads from the logged model (task,
command, signature, artifacts folder), what the command finds there, and the refusals. No engine starts;
tests/model_code/test_entrypoint_container.py runs the command."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import mlflow
import pytest
import yaml
from mlflow.exceptions import MlflowException

from gateway.config import gateway_settings
from launch.config import ConfigError, load_config
from launch.gpu_profiles import DEFAULT_PROFILE
from model_code import engine_owner, log_model
from model_code.entrypoint import COMMAND, DEPLOYMENT_FILE, PORT_ENV
from tests.lora import make_adapter
from tests.model_code.helpers import engine_children

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "tiny-cpu.yaml"
QWEN_7B = REPO / "configs" / "qwen2.5-7b-instruct.yaml"


def _logged(config: Any, **kwargs: Any) -> tuple[Any, Path]:
    with mlflow.start_run():
        info = log_model(config, flavor="entrypoint", **kwargs)
    return info, Path(mlflow.artifacts.download_artifacts(info.model_uri))


@pytest.fixture(scope="module")
def tiny_logged(mlflow_store: Path, tiny_deployment: Any, tiny_model_dir: Path) -> tuple[Any, Path]:
    starts, children = engine_owner.STARTS, set(engine_children())
    logged = _logged(TINY_CONFIG, model_path=tiny_model_dir)
    assert engine_owner.STARTS == starts and set(engine_children()) == children  # no engine at log time
    return logged


def test_the_model_carries_task_command_and_chat_signature(tiny_logged: tuple[Any, Path]) -> None:
    _, files = tiny_logged
    model = yaml.safe_load((files / "MLmodel").read_text())
    assert model["metadata"] == {"task": "llm/v1/chat", "entrypoint": COMMAND}
    inputs, outputs = (yaml.safe_load(model["signature"][part]) for part in ("inputs", "outputs"))
    assert "messages" in {col["name"] for col in inputs}  # Unity Catalog refuses a model without both
    assert "choices" in {col["name"] for col in outputs}
    assert "code" not in model["flavors"]["python_function"] or not model["flavors"]["python_function"]["code"]


def test_the_command_needs_no_shell() -> None:
    assert shlex.split(COMMAND) == COMMAND.split()
    assert not set(COMMAND) & set("$`'\"|&;<>(){}*?~\\")


def test_the_artifacts_folder_holds_what_the_command_runs(
    tiny_logged: tuple[Any, Path], tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, files = tiny_logged
    artifacts = files / "artifacts"
    assert sorted(p.name for p in artifacts.iterdir()) == sorted(
        ["engine_guard", "gateway", "launch", DEPLOYMENT_FILE, tiny_model_dir.name]
    )
    assert (artifacts / "gateway" / "cli.py").is_file() and (artifacts / "launch" / "cpu_shim" / "sgl_kernel").is_dir()
    assert not list(artifacts.rglob("__pycache__")) and not list(artifacts.rglob("*.pyc"))
    assert (artifacts / tiny_model_dir.name / "config.json").is_file()
    written = yaml.safe_load((artifacts / DEPLOYMENT_FILE).read_text())
    assert written["models"]["tiny"]["engine"]["model_path"] == f"./{tiny_model_dir.name}"  # the bare artifact name

    monkeypatch.delenv(PORT_ENV, raising=False)
    deployment = load_config(artifacts / DEPLOYMENT_FILE)  # as the command loads it
    assert list(deployment.models) == ["tiny"]
    assert Path(deployment.engine("tiny").model_path) == artifacts / tiny_model_dir.name
    settings = gateway_settings(deployment)
    assert (settings.host, settings.port) == ("0.0.0.0", 8080)
    monkeypatch.setenv(PORT_ENV, "18080")
    assert gateway_settings(load_config(artifacts / DEPLOYMENT_FILE)).port == 18080


def test_requirements_have_the_engine_and_the_gateway(tiny_logged: tuple[Any, Path]) -> None:
    _, files = tiny_logged
    lines = (files / "requirements.txt").read_text().splitlines()
    assert f"sglang=={DEFAULT_PROFILE.sglang}" in lines  # a CPU engine: SGLang alone, no CUDA stack
    names = [line.split(">")[0].split("=")[0].lower() for line in lines]
    for needed in ("fastapi", "uvicorn", "aiohttp", "typer", "prometheus-client", "mlflow", "openai"):
        assert names.count(needed) == 1, lines


def test_predict_says_where_the_server_is(tiny_logged: tuple[Any, Path]) -> None:
    info, _ = tiny_logged
    model = mlflow.pyfunc.load_model(info.model_uri)
    with pytest.raises(MlflowException, match="'entrypoint' metadata") as raised:
        model.predict({"messages": [{"role": "user", "content": "hi"}]})
    assert raised.value.get_http_status_code() == 501


def test_a_7b_gpu_config_logs_on_a_machine_without_gpu(mlflow_store: Path) -> None:
    """Without local weights the engine loads the Hub id where it is served; the GPU stack profile is pinned."""
    _, files = _logged(QWEN_7B, profile=DEFAULT_PROFILE.name, python="3.11")
    written = yaml.safe_load((files / "artifacts" / DEPLOYMENT_FILE).read_text())
    engine = written["models"]["qwen2.5-7b-instruct"]["engine"]
    assert engine["model_path"] == "Qwen/Qwen2.5-7B-Instruct" and engine["cuda_graph"] is True
    assert "port" not in engine and written["gateway"]["port"] == f"${{{PORT_ENV}:-8080}}"
    lines = (files / "requirements.txt").read_text().splitlines()
    assert all(line in lines for line in DEFAULT_PROFILE.requirements()) and "fastapi>=0.110" in lines


def test_one_model_of_several_is_served_with_its_own_per_model_settings(mlflow_store: Path, tiny_model_dir: Path) -> None:
    """Every per-model setting keeps the served model's entry only: one naming a model left out of the
    logged deployment would make the entrypoint's gateway refuse its own config."""
    config = {
        "models": {
            "chat": {"engine": {"model_path": str(tiny_model_dir), "device": "cpu"}},
            "other": {"url": "http://127.0.0.1:9"},
        },
        "gateway": {
            "model_limits": {"chat": {"max_concurrent": 4}, "other": {"max_concurrent": 1}},
            "swap_policy": {"chat": "stop-first", "other": "blue-green"},
            "model_balancing": {"chat": {"min_ready": 2}, "other": {"policy": "prefix_affinity"}},
            "port": 9000,
        },
    }
    _, files = _logged(config, model="chat")
    path = files / "artifacts" / DEPLOYMENT_FILE
    deployment = load_config(path)
    assert list(deployment.models) == ["chat"]
    settings = gateway_settings(deployment)  # as the entrypoint's `serve` reads it
    assert settings.limits_for("chat").max_concurrent == 4 and set(settings.model_limits) == {"chat"}
    assert settings.swap_policy == {"chat": "stop-first"}
    assert settings.balancing_for("chat").min_ready == 2 and set(settings.model_balancing) == {"chat"}


def _engine_config(tiny_model_dir: Path, **gateway: Any) -> dict[str, Any]:
    return {"models": {"m": {"engine": {"model_path": str(tiny_model_dir), "device": "cpu"}}}, "gateway": gateway}


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"settings": {"defaults": {"max_tokens": 9}}}, ConfigError, "mlflow.defaults"),
        ({"input_example": {"messages": []}}, ValueError, "input_example"),
        ({"registered_model_name": "cat.schema.m"}, ValueError, "env_pack='databricks_model_serving'"),
        ({"task": "agent/v1/chat"}, ValueError, "task"),
        ({"metadata": {"entrypoint": "vllm serve x"}}, ValueError, "metadata.entrypoint"),
        ({"gateway": {"api_keys_env": "KEYS"}}, ConfigError, "gateway.api_keys_env"),
    ],
)
def test_refusals_name_the_key(
    mlflow_store: Path, tiny_model_dir: Path, kwargs: dict[str, Any], error: type[Exception], names: str
) -> None:
    gateway = kwargs.pop("gateway", {})
    with mlflow.start_run(), pytest.raises(error, match=names.replace(".", r"\.").replace("(", r"\(")):
        log_model(_engine_config(tiny_model_dir, **gateway), flavor="entrypoint", **kwargs)


def test_a_url_model_and_a_clashing_weights_name_are_refused(mlflow_store: Path, tmp_path: Path) -> None:
    with mlflow.start_run(), pytest.raises(ConfigError, match="reached at a url"):
        log_model({"models": {"remote": {"url": "http://127.0.0.1:9"}}}, flavor="entrypoint")
    weights = tmp_path / "gateway"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    config = {"models": {"m": {"engine": {"model_path": str(weights), "device": "cpu"}}}}
    with mlflow.start_run(), pytest.raises(ConfigError, match="rename the weights directory"):
        log_model(config, flavor="entrypoint", model_path=weights)


def test_adapters_are_packed_and_served_as_model_names(mlflow_store: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Local adapter directories are copied into the artifacts folder (their own names do not matter: both are
    called ``adapter`` here); one that is not a directory here stays a path the engine loads where it is served."""
    first, second = (make_adapter(tiny_model_dir, tmp_path / name / "adapter", seed) for name, seed in (("one", 1), ("two", 2)))
    adapters = {"support": str(first), "legal": str(second), "remote": "/Volumes/main/adapters/remote"}
    config = {"models": {"tiny": {"engine": {"model_path": str(tiny_model_dir), "device": "cpu"}, "adapters": adapters}}}
    _, files = _logged(config, model_path=tiny_model_dir)
    artifacts = files / "artifacts"
    for name, source in (("support", first), ("legal", second)):
        copied = artifacts / f"lora-{name}"
        assert (copied / "adapter_model.safetensors").read_bytes() == (source / "adapter_model.safetensors").read_bytes()
    written = yaml.safe_load((artifacts / DEPLOYMENT_FILE).read_text())["models"]["tiny"]
    assert written["adapters"] == {"support": "./lora-support", "legal": "./lora-legal", "remote": "/Volumes/main/adapters/remote"}
    assert "lora_paths" not in written["engine"] and "enable_lora" not in written["engine"]
    deployment = load_config(artifacts / DEPLOYMENT_FILE)  # as the command loads it: the copies, beside the file
    assert deployment.engine("tiny").lora_paths["support"] == str(artifacts / "lora-support")
    assert list(deployment.models["tiny"].adapters) == ["support", "legal", "remote"]  # the models tiny:support...

