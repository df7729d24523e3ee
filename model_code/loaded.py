"""What is behind a model that ``mlflow.pyfunc.load_model`` returned: the flavour instance that holds the engine
client, and closing it. Below ``serving`` and ``batch`` alike (both unwrap loaded models); it imports nothing of
this package.
"""

from __future__ import annotations

from typing import Any


def python_model_of(model: Any) -> Any:
    """The flavour instance behind a model from ``mlflow.pyfunc.load_model``.

    ``PyFuncModel.unwrap_python_model()`` does not work for ChatAgent / ChatModel / ResponsesAgent
    models in MLflow 3.17 (their loader wrappers expose ``get_raw_model()`` instead): use this.
    """
    if hasattr(model, "get_raw_model"):
        try:
            return model.get_raw_model()
        except NotImplementedError:
            pass
    if hasattr(model, "unwrap_python_model"):
        return model.unwrap_python_model()
    return model


def close_model(model: Any) -> None:
    """Stop the engine a loaded model started (no-op for URL mode). Same as ``python_model_of(model).close()``."""
    close = getattr(python_model_of(model), "close", None)
    if close is not None:
        close()
