"""The ``entrypoint`` flavour: the gateway in front of one SGLang engine as the model's own server.

Databricks custom LLM serving does not call a pyfunc's ``predict``: it runs the command in the model's
``metadata["entrypoint"]`` from the model's artifacts folder, waits for ``GET /v1/models`` to answer
200 on port 8080, then forwards each endpoint request (an OpenAI chat body) to ``POST /invocations``.
So everything that command needs is logged in the artifacts folder:

- ``sglang-gateway.yaml``: the deployment, reduced to the served model, with ``./`` paths relative to
  itself (the weights) and the gateway on ``0.0.0.0:${SGLANG_GATEWAY_PORT:-8080}``;
- the weights (when given), under their directory's name; the LoRA adapters, copied as ``lora-<name>``
  (served as the models ``<model>:<adapter>``, as the gateway serves them anywhere);
- ``gateway/``, ``engine_guard/`` and ``launch/``: the code of the command. ``python -m`` puts the working directory first
  on ``sys.path``, so the command needs the requirements installed and nothing else (no console script,
  whose shebang would name the logging machine's python).

The command needs no shell: no variable, quote or redirection in it. The pyfunc is a placeholder
(``entrypoint_model.py``) whose ``predict`` refuses, and the model carries the chat signature Unity
Catalog requires of every registered model.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

from launch.config import GATEWAY_KEY_SETTINGS, GATEWAY_PER_MODEL_SETTINGS, ConfigError
from model_code.adapters import stage_adapters
from model_code.flavors.spec import CHAT_TASK
from model_code.paths import PACKAGE_DIR, REPO_DIR
from model_code.target import ADAPTER_ARTIFACT_PREFIX, SETTINGS_KEY, WEIGHTS_ARTIFACT, Target, adapter_artifact

PLACEHOLDER_FILE = PACKAGE_DIR / "entrypoint_model.py"
DEPLOYMENT_FILE = "sglang-gateway.yaml"
CODE_PACKAGES = ("engine_guard", "gateway", "launch")
PORT_ENV = "SGLANG_GATEWAY_PORT"
DEFAULT_PORT = 8080
COMMAND = f"python -u -m gateway.cli serve {DEPLOYMENT_FILE}"
"""Run from the artifacts folder; ``-u`` so the log reaches the endpoint's log as it is written."""
REGISTER_HINT = "mlflow.register_model(info.model_uri, name, env_pack='databricks_model_serving')"


def check_options(
    settings: Mapping[str, Any], input_example: Any, registered_model_name: str | None, metadata: Mapping[str, Any]
) -> None:
    """Refuse what the entrypoint flavour cannot honour, one message each."""
    unused = sorted(set(settings) - {"model"})
    if unused:
        raise ConfigError(
            f"{SETTINGS_KEY}.{unused[0]}: the wrapper settings do not apply to the entrypoint flavour "
            "(the gateway serves requests as clients send them); put defaults in the requests"
        )
    if input_example is not None:
        raise ValueError("input_example: the entrypoint flavour's predict never runs, so it takes no input example")
    if registered_model_name is not None:
        raise ValueError(
            "registered_model_name: custom LLM serving needs the environment packed with the model version; "
            f"register with {REGISTER_HINT}"
        )
    if metadata.get("task", CHAT_TASK) != CHAT_TASK:
        raise ValueError(f"task: custom LLM serving serves {CHAT_TASK!r} (chat) only, got {metadata['task']!r}")
    if "entrypoint" in metadata:
        raise ValueError("metadata.entrypoint: the entrypoint flavour writes the command itself")


def serving_deployment(
    model_config: Mapping[str, Any], target: Target, weights_dir: str | None, packed: Collection[str] = ()
) -> dict[str, Any]:
    """The deployment the entrypoint serves: ``target``'s model alone, its weights at ``./weights_dir``
    (when logged), the adapters staged as the artifacts ``packed`` at ``./lora-<name>``, the gateway on all
    interfaces at the port variable (8080 when unset)."""
    if target.engine is None:
        raise ConfigError(
            f"model {target.name!r} is reached at a url: the entrypoint flavour serves an engine on the endpoint's GPU"
        )
    gateway = dict(model_config.get("gateway") or {})
    # The platform authenticates callers itself and (as far as is known) sends no key of theirs to the
    # model's server: a gateway that asked for one would refuse every request.
    keys = [key for key in GATEWAY_KEY_SETTINGS if gateway.get(key)]
    if keys:
        raise ConfigError(
            f"gateway.{keys[0]}: the serving platform authenticates callers itself and sends the model's server "
            "no key; remove the gateway keys from a deployment logged as an entrypoint"
        )
    for key in GATEWAY_PER_MODEL_SETTINGS:  # the served model's entries only: the others name no model here
        if key in gateway:
            gateway[key] = {name: value for name, value in gateway[key].items() if name == target.name}
    gateway.update(host="0.0.0.0", port=f"${{{PORT_ENV}:-{DEFAULT_PORT}}}")
    engine = target.engine.model_dump(mode="json", exclude_defaults=True)
    engine.pop("port", None)  # the engine's port is private; a fixed one could take the gateway's
    if weights_dir is not None:
        engine["model_path"] = f"./{weights_dir}"
    if "lora_paths" in engine:
        engine["lora_paths"] = {name: f"./{adapter_artifact(name)}" if adapter_artifact(name) in packed else path for name, path in engine["lora_paths"].items()}
    entry: dict[str, Any] = {"engine": engine}
    served = target.deployment.models[target.name]
    if served.adapters:  # each served as the model "<name>:<adapter>", as the gateway serves them anywhere
        entry["adapters"] = engine.pop("lora_paths")
        engine.pop("enable_lora", None)
    if served.adapter_aliases:
        entry["adapter_aliases"] = dict(served.adapter_aliases)
    if served.aliases:
        entry["aliases"] = list(served.aliases)
    return {"models": {target.name: entry}, "gateway": gateway}


def deployment_yaml(deployment: Mapping[str, Any]) -> str:
    header = (
        f"# Served by this model's entrypoint, `{COMMAND}`, run from the model's artifacts folder.\n"
        f"# ./ paths are relative to this file; {PORT_ENV} sets the port (default {DEFAULT_PORT}).\n"
    )
    return header + yaml.safe_dump(dict(deployment), sort_keys=False)


def stage_artifacts(deployment: Mapping[str, Any], weights: Path | None, into: Path) -> dict[str, str]:
    """Write the artifacts folder's files into ``into`` (weights stay where they are): MLflow's artifacts mapping.

    MLflow names each artifact's folder after its source, so the staged names are the served names.
    """
    (into / DEPLOYMENT_FILE).write_text(deployment_yaml(deployment))
    artifacts = {"deployment": str(into / DEPLOYMENT_FILE)}
    for package in CODE_PACKAGES:
        source = REPO_DIR / package
        if not (source / "__init__.py").is_file():
            raise FileNotFoundError(
                f"{source}: the entrypoint flavour ships the gateway's code and did not find it; log from a checkout "
                "of sglang-gateway or with the package installed"
            )
        shutil.copytree(source, into / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        artifacts[f"{package}-code"] = str(into / package)
    if weights is not None:
        artifacts[WEIGHTS_ARTIFACT] = str(weights)
    return artifacts


def log_entrypoint_model(
    model_config: Mapping[str, Any],
    target: Target,
    *,
    weights: Path | None,
    name: str,
    requirements: list[str],
    metadata: dict[str, Any],
    **log_kwargs: Any,
) -> Any:
    """Log ``target`` as a custom-LLM-serving model (see the module docstring); starts no engine.

    ``metadata`` gets the chat task and the command. Returns MLflow's ``ModelInfo``.
    """
    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types.llm import CHAT_MODEL_INPUT_SCHEMA, CHAT_MODEL_OUTPUT_SCHEMA

    reserved = {DEPLOYMENT_FILE, *CODE_PACKAGES}
    if weights is not None and (weights.name in reserved or weights.name.startswith(ADAPTER_ARTIFACT_PREFIX)):
        raise ConfigError(
            f"model_path {weights}: the artifacts folder needs the name {weights.name!r} for the gateway; "
            "rename the weights directory"
        )
    metadata = {**metadata, "task": CHAT_TASK, "entrypoint": COMMAND}
    with tempfile.TemporaryDirectory(prefix="sglang-gateway-entrypoint-") as staging:
        adapters = stage_adapters(target.engine.lora_paths, Path(staging)) if target.engine is not None else {}
        deployment = serving_deployment(model_config, target, weights.name if weights is not None else None, adapters)
        return mlflow.pyfunc.log_model(
            name=name,
            python_model=str(PLACEHOLDER_FILE),
            artifacts={**stage_artifacts(deployment, weights, Path(staging)), **adapters},
            pip_requirements=requirements,
            metadata=metadata,
            signature=ModelSignature(inputs=CHAT_MODEL_INPUT_SCHEMA, outputs=CHAT_MODEL_OUTPUT_SCHEMA),
            **log_kwargs,
        )
