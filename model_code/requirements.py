"""``pip_requirements`` of a logged model: one GPU stack profile (``launch.gpu_profiles``), wheel-pinned.

A GPU target gets the profile's exact pins (SGLang, torch, sglang-kernel) and FlashInfer as direct
wheel URLs (resolving FlashInfer through an index fails on Databricks Model Serving; a direct wheel
URL works). Only combinations of the profile table can be written: anything else is an
:class:`~launch.gpu_profiles.UnknownGpuProfile` that lists the profiles. ``flashinfer="https://...whl"``
(one URL or a list) replaces the profile's FlashInfer wheels with yours.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from launch.gpu_profiles import DEFAULT_PROFILE, GpuProfile, UnknownGpuProfile, current_python, select_profile

SGLANG_VERSION = DEFAULT_PROFILE.sglang
TORCH_VERSION = DEFAULT_PROFILE.torch
FLASHINFER_VERSION = DEFAULT_PROFILE.flashinfer

__all__ = [
    "FLASHINFER_VERSION",
    "SGLANG_VERSION",
    "TORCH_VERSION",
    "UnknownGpuProfile",
    "gateway_requirements",
    "gpu_stack_lines",
    "pip_requirements",
    "target_profile",
]


def target_profile(
    profile: str | None = None, *, cuda: str | None = None, python: str | None = None, driver: str | None = None
) -> GpuProfile:
    """The profile to pin: by name, or by CUDA version, or the one the serving host's ``driver`` runs (``"12.4"``,
    the CUDA version its ``nvidia-smi`` shows, or ``"550.54.15"``), else the default; a named profile is checked
    against ``driver``. ``python`` defaults to this interpreter's, which MLflow also records as the model's python."""
    return select_profile(profile, cuda=cuda, python=python or current_python(), driver=driver)


def gpu_stack_lines(profile: GpuProfile, flashinfer: str | Sequence[str] | None = "auto") -> list[str]:
    """The lines of a GPU target: the profile's pins (torch, sglang-kernel, SGLang) and FlashInfer.

    ``flashinfer="auto"``: the profile's wheel URLs; a URL or a list of URLs: used verbatim (your
    wheels); ``None``: no FlashInfer line (the serving image provides it, or SGLang's own pin on the
    registry's ``flashinfer_python`` is good enough).
    """
    if flashinfer == "auto":
        wheels = list(profile.flashinfer_wheels())
    elif flashinfer is None:
        wheels = []
    else:
        wheels = [flashinfer] if isinstance(flashinfer, str) else list(flashinfer)
        bad = [u for u in wheels if not (u.startswith(("https://", "http://", "file:")) and u.endswith(".whl"))]
        if bad:
            raise ValueError(f"flashinfer: expected direct wheel URLs (https://...whl), got {bad}")
    return [*profile.pins(), *wheels]


def _pin(name: str) -> str:
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


PROJECT = "sglang-gateway"
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def gateway_requirements() -> list[str]:
    """The gateway's runtime requirements (``project.dependencies``), for a model whose entrypoint runs it.

    From the checkout's ``pyproject.toml`` when logging from one (the source of truth), else from the
    installed distribution's metadata.
    """
    if _PYPROJECT.is_file():
        project = tomllib.loads(_PYPROJECT.read_text())["project"]
        if project.get("name") == PROJECT:
            return list(project["dependencies"])
    return [line for line in metadata.requires(PROJECT) or [] if "extra ==" not in line]


def _project(line: str) -> str:
    """The project a requirement line names (a direct wheel URL names itself)."""
    try:
        return canonicalize_name(Requirement(line).name)
    except InvalidRequirement:
        return line


def pip_requirements(
    flashinfer: str | Sequence[str] | None = "auto",
    *,
    profile: str | None = None,
    cuda: str | None = None,
    python: str | None = None,
    driver: str | None = None,
    gpu: bool = True,
    gateway: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """The full ``pip_requirements`` list: MLflow's defaults, this package's runtime deps, the GPU stack.

    ``gpu=False`` (a CPU engine) writes SGLang alone: no CUDA torch, kernels or FlashInfer lines. The
    profile is checked either way. ``openai`` is left to SGLang's own exact pin, so a logging
    environment with another openai cannot write a requirement set that conflicts with SGLang's.
    ``gateway=True`` adds the gateway's own requirements (for projects not already listed), for a
    model that runs the gateway.
    """
    import mlflow.pyfunc

    stack = target_profile(profile, cuda=cuda, python=python, driver=driver)
    lines = [
        *mlflow.pyfunc.get_default_pip_requirements(),
        _pin("mlflow"),
        "openai",
        _pin("pydantic"),
        _pin("PyYAML"),
        _pin("httpx"),
        _pin("loguru"),
        *(gpu_stack_lines(stack, flashinfer) if gpu else [f"sglang=={stack.sglang}"]),
    ]
    if gateway:
        listed = {_project(line) for line in lines}
        lines += [line for line in gateway_requirements() if _project(line) not in listed]
    lines += extra
    seen: set[str] = set()
    return [line for line in lines if not (line in seen or seen.add(line))]
