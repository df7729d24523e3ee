"""The flavours ``log_model``, ``load_for_serving`` and the tests know: one row per flavour module.

A new flavour is a module in this package (its :class:`FlavorSpec` as ``SPEC``, its class, its
models-from-code entry) and its line here. Importing this loads every flavour (and MLflow's pyfunc).
"""

from __future__ import annotations

from typing import Any

from model_code.flavors import chat_agent, chat_model, responses_agent
from model_code.flavors.spec import FlavorSpec

FLAVORS: dict[str, FlavorSpec] = {
    spec.name: spec
    for spec in (
        responses_agent.SPEC,  # MLflow's recommended interface: OpenAI Responses-style input
        chat_agent.SPEC,  # agent notebooks: generation parameters inside custom_inputs
        chat_model.SPEC,  # chat endpoints: OpenAI chat fields at the top level
    )
}


def flavor_of(python_model: Any) -> str:
    """The flavour of a loaded model's python model (by its ``mlflow.pyfunc`` base class).

    By base class, not by our class: a loaded model is an instance of the class its executed file defined
    (module ``code_model_<hex>``), not of the same class imported from this package.
    """
    import mlflow.pyfunc

    for spec in FLAVORS.values():
        if isinstance(python_model, getattr(mlflow.pyfunc, spec.mlflow_class)):
            return spec.name
    raise TypeError(f"not a chat model: {type(python_model).__name__} (log it with model_code.log_model)")
