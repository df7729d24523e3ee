"""MLflow models-from-code file of the ``entrypoint`` flavour: a placeholder, never the server.

Databricks custom LLM serving does not load this model: it runs the command in the model's
``entrypoint`` metadata (the gateway in front of SGLang, from the model's artifacts folder) and sends
requests to that server. Anyone who loads the model and calls ``predict`` gets an error saying so.
Imports MLflow alone, so the model loads anywhere (no ``code_paths``).
"""

from mlflow.exceptions import MlflowException
from mlflow.models import set_model
from mlflow.protos.databricks_pb2 import NOT_IMPLEMENTED
from mlflow.pyfunc import PythonModel

NOT_SERVED_HERE = (
    "this model is served by the command in its 'entrypoint' metadata, not by predict: deploy it on "
    "Databricks custom LLM serving, or run that command in the model's artifacts folder and send OpenAI "
    "chat requests to its POST /invocations (or /v1/chat/completions)"
)


class EntrypointOnly(PythonModel):
    """The pyfunc face of a model whose server is its entrypoint command."""

    # No type hints: MLflow would infer an input schema from them; the logged signature is the chat one.
    def predict(self, context, model_input, params=None):
        raise MlflowException(NOT_SERVED_HERE, error_code=NOT_IMPLEMENTED)


set_model(EntrypointOnly())
