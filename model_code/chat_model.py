"""MLflow models-from-code file: the SGLang engine as a ``ChatModel`` (OpenAI chat schema).

Log it with ``model_code.log_model(config, flavor="chat_model")``. ``ChatModel`` is deprecated in
MLflow 3 in favour of ``ResponsesAgent``, but it is the closest to the OpenAI chat API.
"""

from mlflow.models import set_model

from model_code.flavors import SGLangChatModel

set_model(SGLangChatModel())
