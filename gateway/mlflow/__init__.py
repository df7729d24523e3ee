"""Serving a logged MLflow model: ``sglang-gateway serve --model-uri`` and ``POST /invocations``."""
