"""MLflow models-from-code file: the SGLang engine as a ``ChatAgent``.

Log it with ``model_code.log_model(config, flavor="chat_agent")`` (or pass this file as
``python_model=`` to ``mlflow.pyfunc.log_model``). Generation parameters go in ``custom_inputs``.
"""

from mlflow.models import set_model

from model_code.flavors import SGLangChatAgent

set_model(SGLangChatAgent())
