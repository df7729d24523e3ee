"""``log_model``: one call from a deployment YAML (or dict) to a logged MLflow model, without starting an engine."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from launch.config import ConfigError, load_config
from model_code.adapters import stage_adapters
from model_code.entrypoint import check_options, log_entrypoint_model
from model_code.flavors.spec import CHAT_TASK
from model_code.paths import PACKAGE_DIR, REPO_DIR
from model_code.requirements import pip_requirements as computed_requirements
from model_code.target import NO_ENGINE_ENV, SETTINGS_KEY, WEIGHTS_ARTIFACT, resolve_target, split_model_config
from model_code.weights import packable

CODE_PATHS = [str(REPO_DIR / "launch"), str(REPO_DIR / "engine_guard"), str(PACKAGE_DIR)]  # the whole package: every flavour module is there

ENTRYPOINT_FLAVOR = "entrypoint"  # Databricks custom LLM serving: see model_code.entrypoint


@contextlib.contextmanager
def no_engine() -> Iterator[None]:
    """Load models without starting an engine while the block runs (what ``log_model`` uses)."""
    previous = os.environ.get(NO_ENGINE_ENV)
    os.environ[NO_ENGINE_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(NO_ENGINE_ENV, None)
        else:
            os.environ[NO_ENGINE_ENV] = previous


def config_dict(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A plain ``model_config`` mapping: a YAML path is read with ``${VAR}`` expansion and relative paths resolved.

    A YAML file stays loadable by the gateway, so it has no ``mlflow:`` section: give the wrapper
    settings to :func:`log_model` as ``settings=`` (a mapping may carry an ``mlflow:`` key itself).
    """
    if isinstance(config, Mapping):
        data = dict(config)
    else:
        path = Path(config)
        deployment = load_config(path)  # validates, expands ${VAR}, resolves ./ paths against the file
        data = {"models": deployment.model_dump(mode="json", exclude_defaults=True)["models"]}
        if deployment.gateway:
            data["gateway"] = dict(deployment.gateway)
    deployment_part, _ = split_model_config(data)  # bare engine section -> models mapping; settings checked
    settings = data.get(SETTINGS_KEY)
    return {**deployment_part, **({SETTINGS_KEY: settings} if settings else {})}


def log_model(
    config: str | os.PathLike[str] | Mapping[str, Any],
    *,
    flavor: str = "responses_agent",
    model_path: str | os.PathLike[str] | None = None,
    name: str = "model",
    registered_model_name: str | None = None,
    task: str | None = None,
    profile: str | None = None,
    cuda: str | None = None,
    driver: str | None = None,
    python: str | None = None,
    flashinfer: str | Sequence[str] | None = "auto",
    extra_pip_requirements: Sequence[str] = (),
    pip_requirements: Sequence[str] | None = None,
    input_example: Mapping[str, Any] | None = None,
    model: str | None = None,
    settings: Mapping[str, Any] | None = None,
    **log_kwargs: Any,
) -> Any:
    """Log the SGLang engine of ``config`` as an MLflow models-from-code model. Starts no engine.

    Args:
        config: deployment YAML path, or the same as a mapping (a bare engine section works too).
            It becomes the model's ``model_config``; an optional ``mlflow:`` section configures the
            wrapper (see :class:`model_code.target.ModelCodeSettings`).
        flavor: ``responses_agent`` (MLflow's recommended interface), ``chat_agent`` or ``chat_model``; or
            ``entrypoint``: the gateway and the engine as the model's own server, for Databricks custom LLM
            serving (see :mod:`model_code.entrypoint`; register it with
            ``mlflow.register_model(uri, name, env_pack="databricks_model_serving")``).
        model_path: local weights directory, logged as the ``llm-model`` artifact and used instead of the
            config's ``model_path`` when the model is loaded. ``None``: the engine loads the config's
            ``model_path`` where the model is served (a Hugging Face id or a path such as ``/Volumes/...``).
            The served model's LoRA adapters (``adapters:``) that are local directories are packed as the
            artifacts ``lora-<name>`` (:mod:`model_code.adapters`), whatever ``model_path`` is.
        name: the model's name in the run (``name=`` of ``mlflow.pyfunc.log_model``).
        registered_model_name: also register it (e.g. ``catalog.schema.model`` in Unity Catalog).
        task: metadata task override, e.g. ``"llm/v1/chat"`` (``"chat"`` is short for it): lets Databricks
            serve a ChatAgent / ResponsesAgent without the agents SDK. ``None`` keeps MLflow's
            (``agent/v2/chat``, ``agent/v1/chat``, ``agent/v1/responses``).
        profile: the GPU stack profile to pin (``launch.gpu_profiles``: SGLang, torch, CUDA, FlashInfer),
            by name; ``None``: the one for ``cuda``, else the one ``driver`` runs, else the default. An unknown
            name, a CUDA version without a profile, a profile the ``driver`` cannot run or a python the profile
            has no wheels for raises ``UnknownGpuProfile`` listing the profiles.
        cuda: the profile's CUDA version (``"13.0"``, ``"12.8"``), an alternative to naming the profile.
        driver: the serving host's NVIDIA driver, as the CUDA version its ``nvidia-smi`` shows (``"12.4"``) or
            as its version (``"550.54.15"``): picks the profile that runs there (natively if one does, else under
            NVIDIA's minor-version compatibility), or checks the named one. Databricks Model Serving today:
            ``driver="12.4"`` (docs/databricks.md).
        python: the serving python X.Y (default: this interpreter's, which MLflow records as the model's).
        flashinfer: ``"auto"`` (the profile's FlashInfer wheel URLs), a wheel URL or list of URLs, or
            ``None`` (no FlashInfer line). A CPU engine config gets SGLang alone, no GPU stack lines.
        extra_pip_requirements: appended to the computed requirements; ``pip_requirements`` replaces them.
        model: which entry of ``models`` to serve, when the config has several (same as ``mlflow.model``).
        settings: the wrapper's ``mlflow:`` section (``defaults``, ``request_timeout_s``, ``api_key_env``...),
            merged over the one a mapping ``config`` may carry.
        log_kwargs: passed to ``mlflow.pyfunc.log_model`` (``metadata``, ``tags``, ``await_registration_for``...).

    Returns:
        MLflow's ``ModelInfo``.
    """
    import mlflow

    from model_code.flavors.table import FLAVORS  # loads the flavours (and MLflow's pyfunc): only when logging

    if flavor not in FLAVORS and flavor != ENTRYPOINT_FLAVOR:
        raise ValueError(f"flavor must be one of {', '.join([*FLAVORS, ENTRYPOINT_FLAVOR])}, got {flavor!r}")
    model_config = config_dict(config)
    merged_settings = {**model_config.get(SETTINGS_KEY, {}), **(settings or {}), **({"model": model} if model else {})}
    if merged_settings:
        model_config[SETTINGS_KEY] = merged_settings
    artifacts = None
    if model_path is not None:
        weights = Path(model_path).expanduser()
        if not weights.is_dir():
            raise ConfigError(
                f"model_path {model_path}: not a local directory (give None to let the engine load the config's model_path)"
            )
        artifacts = {WEIGHTS_ARTIFACT: str(weights.resolve())}
    target = resolve_target(model_config, artifacts)  # fail here, not at serving time
    if target.engine is None and artifacts:
        raise ConfigError(f"model {target.name!r} is reached at a url: model_path (weights) would not be used")

    metadata = dict(log_kwargs.pop("metadata", None) or {})
    if task is not None:
        metadata["task"] = CHAT_TASK if task == "chat" else task
    requirements = (
        list(pip_requirements)
        if pip_requirements is not None
        else computed_requirements(
            flashinfer,
            profile=profile,
            cuda=cuda,
            python=python,
            driver=driver,
            gpu=not _is_cpu(target),
            gateway=flavor == ENTRYPOINT_FLAVOR,
        )
    )
    requirements += list(extra_pip_requirements)
    if flavor == ENTRYPOINT_FLAVOR:  # before any weights are mirrored (a copy, across filesystems)
        check_options(merged_settings, input_example, registered_model_name, metadata)
    with contextlib.ExitStack() as packing:
        if artifacts:  # a Hugging Face cache snapshot links out of its folder, which MLflow refuses: model_code.weights
            artifacts = {WEIGHTS_ARTIFACT: str(packing.enter_context(packable(Path(artifacts[WEIGHTS_ARTIFACT]))))}
        if flavor == ENTRYPOINT_FLAVOR:
            weights = Path(artifacts[WEIGHTS_ARTIFACT]) if artifacts else None
            return log_entrypoint_model(
                model_config, target, weights=weights, name=name, requirements=requirements, metadata=metadata, **log_kwargs
            )

        lora_paths = target.engine.lora_paths if target.engine is not None else {}
        with no_engine(), tempfile.TemporaryDirectory(prefix="sglang-gateway-adapters-") as staging:
            artifacts = {**(artifacts or {}), **stage_adapters(lora_paths, Path(staging))} or None
            return mlflow.pyfunc.log_model(
                name=name,
                python_model=str(FLAVORS[flavor].path),
                model_config=model_config,
                artifacts=artifacts,
                code_paths=CODE_PATHS,
                pip_requirements=requirements,
                input_example=dict(input_example) if input_example is not None else FLAVORS[flavor].input_example,
                metadata=metadata or None,
                registered_model_name=registered_model_name,
                **log_kwargs,
            )


def _is_cpu(target: Any) -> bool:
    return target.engine is not None and target.engine.device == "cpu"
