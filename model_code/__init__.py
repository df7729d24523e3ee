"""MLflow packaging of the SGLang engine: three models-from-code flavours, ``log_model``, batch, serving.

Uses ``launch`` to start engines; never imports ``gateway``. Names are imported lazily so that the
models-from-code files load only what they need. A map:

``flavors/``        one module per flavour (``responses_agent``, ``chat_agent``, ``chat_model``), each its own
                    models-from-code file; ``common`` what they share; ``table`` ``FLAVORS`` (map: ``flavors/__init__``)
``params``          generation parameters -> validated ``chat.completions`` kwargs (shared by the flavours)
``client``          the engine client a flavour talks through (``target``: which engine, from ``model_config``)
``guard``           every call's engine request checked by ``engine_guard``, as the gateway checks it;
                    ``quarantine`` calls the engine crashed or froze under: not retried, their shape refused
``engine_owner``    the engines this process started; ``replica_set`` a model's replicas
``tracing``         one MLflow trace per call, recorded after it; ``errors`` typed errors with ``status_code``
``log``             ``log_model``: a deployment YAML -> a logged model (``requirements``: its pinned GPU stack;
                    ``weights``: a weights folder that links out of itself, a Hugging Face snapshot, made packable)
``entrypoint``      the ``entrypoint`` flavour (the gateway as the model's server; ``entrypoint_model`` its placeholder)
``agent_server``    the ResponsesAgent flavour behind MLflow's ``AgentServer`` (a Databricks App): ``python -m
                    model_code.agent_server SOURCE``, N workers on one engine
``serving``         ``load_for_serving``: a logged model that takes serving request bodies; ``batch`` many prompts
                    (``batch_job``: as one job of a gateway's batch API, ``via="batch"``, which survives the kernel)
``loaded``          the flavour instance behind a loaded model (``python_model_of``), ``close_model``
``paths``           where the packed code lives (``code_paths``)
``stack_check``     ``doctor``: a logged model's pinned GPU stack against this host, before anything starts
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "log_model": "model_code.log",
    "batch_predict": "model_code.batch",
    "submit_batch": "model_code.batch",
    "batch_results": "model_code.batch",
    "load_for_serving": "model_code.serving",
    "close_model": "model_code.loaded",
    "python_model_of": "model_code.loaded",
    "stop_all": "model_code.engine_owner",
    "EngineClient": "model_code.client",
    "ModelCodeSettings": "model_code.target",
    "pip_requirements": "model_code.requirements",
    "gpu_stack_lines": "model_code.requirements",
    "UnknownGpuProfile": "model_code.requirements",
    "doctor": "model_code.stack_check",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'model_code' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
