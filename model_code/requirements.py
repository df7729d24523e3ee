"""``pip_requirements`` of a logged model: SGLang pinned, FlashInfer as direct wheel URLs matched to the
target's torch / CUDA / python (seed 002: resolving FlashInfer through an index on Databricks fails;
a direct wheel URL works).

``sglang==0.5.23`` pins ``torch==2.14.1`` and ``flashinfer_python==0.7.2``. FlashInfer 0.7 ships a
CUDA-independent ``flashinfer_python`` wheel plus a per-CUDA ``flashinfer_jit_cache`` wheel (pre-built
kernels; without it kernels are compiled on first use, which needs ``nvcc`` on the serving host).
The table lists the combinations known to fit; anything else is an :class:`UnknownFlashInferTarget`
that names them, or pass ``flashinfer="https://...whl"`` (one URL or a list) to choose yourself.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.14.1"
FLASHINFER_VERSION = "0.7.2"
FLASHINFER_RELEASES = "https://github.com/flashinfer-ai/flashinfer/releases/download"
TORCH_INDEX = "https://download.pytorch.org/whl"
SUPPORTED_PYTHONS = ("3.10", "3.11", "3.12", "3.13")


class UnknownFlashInferTarget(ValueError):
    """No known FlashInfer wheel for the requested torch / CUDA / python combination."""


@dataclass(frozen=True)
class FlashInferTarget:
    torch: str
    cuda: str
    python: str

    @property
    def cuda_tag(self) -> str:
        return "cu" + self.cuda.replace(".", "")


def _wheels(cuda_tag: str, version: str = FLASHINFER_VERSION) -> tuple[str, ...]:
    base = f"{FLASHINFER_RELEASES}/v{version}"
    return (
        f"{base}/flashinfer_python-{version}-py3-none-any.whl",
        f"{base}/flashinfer_jit_cache-{version}+{cuda_tag}-cp39-abi3-manylinux_2_28_x86_64.whl",
    )


# (torch, cuda) -> (torch requirement lines, FlashInfer wheel URLs); every python in SUPPORTED_PYTHONS.
# torch 2.14.1 on PyPI is the CUDA 13.0 build; other CUDA builds come from the PyTorch index.
FLASHINFER_TABLE: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {
    (TORCH_VERSION, "13.0"): ((f"torch=={TORCH_VERSION}",), _wheels("cu130")),
    (TORCH_VERSION, "12.9"): (
        (f"--extra-index-url {TORCH_INDEX}/cu129", f"torch=={TORCH_VERSION}+cu129"),
        _wheels("cu129"),
    ),
    (TORCH_VERSION, "12.8"): (
        (f"--extra-index-url {TORCH_INDEX}/cu128", f"torch=={TORCH_VERSION}+cu128"),
        _wheels("cu128"),
    ),
}
DEFAULT_CUDA = "13.0"


def known_targets() -> list[str]:
    return [f"torch {t} / CUDA {c} / python {', '.join(SUPPORTED_PYTHONS)}" for (t, c) in FLASHINFER_TABLE]


def current_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def flashinfer_lines(
    flashinfer: str | Sequence[str] | None = "auto",
    *,
    torch: str = TORCH_VERSION,
    cuda: str = DEFAULT_CUDA,
    python: str | None = None,
) -> list[str]:
    """Requirement lines for torch + FlashInfer.

    ``flashinfer="auto"`` looks ``(torch, cuda, python)`` up in :data:`FLASHINFER_TABLE` (python
    defaults to this interpreter's, which MLflow also records as the model's python); a URL or a list
    of URLs is used verbatim (your choice of wheels, torch left to SGLang's pin); ``None`` adds no
    FlashInfer line (CPU targets, or when the serving image provides it).
    """
    if flashinfer is None:
        return []
    if isinstance(flashinfer, str) and flashinfer != "auto":
        flashinfer = [flashinfer]
    if not isinstance(flashinfer, str):
        urls = list(flashinfer)
        bad = [u for u in urls if not (u.startswith(("https://", "http://", "file:")) and u.endswith(".whl"))]
        if bad:
            raise ValueError(f"flashinfer: expected direct wheel URLs (https://...whl), got {bad}")
        return urls
    target = FlashInferTarget(torch, cuda, python or current_python())
    entry = FLASHINFER_TABLE.get((target.torch, target.cuda))
    if entry is None or target.python not in SUPPORTED_PYTHONS:
        raise UnknownFlashInferTarget(
            f"no known FlashInfer {FLASHINFER_VERSION} wheel for torch {target.torch} / CUDA {target.cuda} / python "
            f"{target.python} (sglang {SGLANG_VERSION}). Known: "
            + "; ".join(known_targets())
            + ". Pass flashinfer='https://...whl' to choose the wheel yourself, or flashinfer=None for none."
        )
    torch_lines, wheels = entry
    return [*torch_lines, *wheels]


def _pin(name: str) -> str:
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def pip_requirements(
    flashinfer: str | Sequence[str] | None = "auto",
    *,
    torch: str = TORCH_VERSION,
    cuda: str = DEFAULT_CUDA,
    python: str | None = None,
    sglang: str | None = f"sglang=={SGLANG_VERSION}",
    extra: Sequence[str] = (),
) -> list[str]:
    """The full ``pip_requirements`` list: MLflow's defaults, this package's runtime deps, torch + FlashInfer, SGLang."""
    import mlflow.pyfunc

    lines = [
        *mlflow.pyfunc.get_default_pip_requirements(),
        _pin("mlflow"),
        _pin("openai"),
        _pin("pydantic"),
        _pin("PyYAML"),
        _pin("httpx"),
        _pin("loguru"),
        *flashinfer_lines(flashinfer, torch=torch, cuda=cuda, python=python),
    ]
    if sglang:
        lines.append(sglang)
    lines.extend(extra)
    seen: set[str] = set()
    return [line for line in lines if not (line in seen or seen.add(line))]
