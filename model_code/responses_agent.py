"""MLflow models-from-code file: the SGLang engine as a ``ResponsesAgent`` (MLflow's recommended interface).

Log it with ``model_code.log_model(config, flavor="responses_agent")``.
"""

from mlflow.models import set_model

from model_code.flavors import SGLangResponsesAgent

set_model(SGLangResponsesAgent())
