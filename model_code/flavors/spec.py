"""A flavour's row in the flavour table (:class:`FlavorSpec`), what every chat flavour shares at log time, and the
test a flavour module makes before it sets itself as MLflow's model (:func:`executed_by_mlflow`).

No MLflow import: ``model_code.log`` and ``model_code.entrypoint`` read it without loading the flavours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHAT_TASK = "llm/v1/chat"  # the MLflow task of every chat flavour (and of the entrypoint model)
QUESTION = [{"role": "user", "content": "What is Databricks?"}]  # the input examples' conversation


@dataclass(frozen=True)
class FlavorSpec:
    """One flavour: its name, its models-from-code file, its ``mlflow.pyfunc`` base class (by name) and the input
    example MLflow validates at log time (the request shape users of that flavour already send)."""

    name: str
    path: Path  # given to ``mlflow.pyfunc.log_model(python_model=...)``: the flavour's own module
    mlflow_class: str
    input_example: dict[str, Any] = field(default_factory=dict)


def executed_by_mlflow(package: str | None) -> bool:
    """Whether a flavour module (given its ``__package__``) runs as its models-from-code file, not imported.

    ``mlflow.pyfunc.log_model(python_model=<file>)``, and loading the logged model, execute the file as a top-level
    module of its own (``code_model_<hex>``: ``__package__`` is ``""``); imported as ``model_code.flavors.<name>``
    (by the table, the tests) it has its package. Only the former calls ``set_model``.
    """
    return not package
