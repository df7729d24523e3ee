"""The MLflow flavours this package logs, in one table.

Each row names the models-from-code file (in this package), the ``mlflow.pyfunc`` base class its model
derives from, and the input example MLflow validates at log time (the request shape users of that flavour
already send). ``log_model``, ``load_for_serving`` and the tests read this table: a new flavour is a row
here, its file, and its class in :mod:`model_code.flavors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
CHAT_TASK = "llm/v1/chat"  # the MLflow task of every chat flavour (and of the entrypoint model)
_QUESTION = [{"role": "user", "content": "What is Databricks?"}]


@dataclass(frozen=True)
class FlavorSpec:
    name: str
    code_file: str
    mlflow_class: str
    input_example: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        """The models-from-code file given to ``mlflow.pyfunc.log_model(python_model=...)``."""
        return PACKAGE_DIR / self.code_file


FLAVORS: dict[str, FlavorSpec] = {
    spec.name: spec
    for spec in (
        # MLflow's recommended interface: OpenAI Responses-style input
        FlavorSpec(
            "responses_agent",
            "responses_agent.py",
            "ResponsesAgent",
            {"input": _QUESTION, "temperature": 0.1, "max_output_tokens": 50},
        ),
        # agent notebooks: generation parameters inside custom_inputs
        FlavorSpec(
            "chat_agent",
            "chat_agent.py",
            "ChatAgent",
            {"messages": _QUESTION, "custom_inputs": {"temperature": 0.1, "max_tokens": 50}},
        ),
        # chat endpoints: OpenAI chat fields at the top level
        FlavorSpec(
            "chat_model", "chat_model.py", "ChatModel", {"messages": _QUESTION, "temperature": 0.1, "max_tokens": 50}
        ),
    )
}


def flavor_of(python_model: Any) -> str:
    """The flavour of a loaded model's python model (by its ``mlflow.pyfunc`` base class)."""
    import mlflow.pyfunc

    for spec in FLAVORS.values():
        if isinstance(python_model, getattr(mlflow.pyfunc, spec.mlflow_class)):
            return spec.name
    raise TypeError(f"not a chat model: {type(python_model).__name__} (log it with model_code.log_model)")
