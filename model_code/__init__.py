"""MLflow packaging of the SGLang engine: three models-from-code flavours, ``log_model``, batch, serving.

Uses ``launch`` to start engines; never imports ``gateway``. Names are imported lazily so that the
models-from-code files load only what they need.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "log_model": "model_code.log",
    "batch_predict": "model_code.batch",
    "load_for_serving": "model_code.serving",
    "close_model": "model_code.serving",
    "python_model_of": "model_code.serving",
    "stop_all": "model_code.engine_owner",
    "EngineClient": "model_code.client",
    "ModelCodeSettings": "model_code.target",
    "pip_requirements": "model_code.requirements",
    "gpu_stack_lines": "model_code.requirements",
    "UnknownGpuProfile": "model_code.requirements",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'model_code' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
