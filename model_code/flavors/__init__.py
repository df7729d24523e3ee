"""The MLflow chat interfaces over one SGLang engine: one module per flavour, each its own models-from-code file.

``responses_agent``  ``ResponsesAgent`` (MLflow's recommended interface): Responses-style requests and events
``chat_agent``       ``ChatAgent`` (agent notebooks): generation parameters in ``custom_inputs``
``chat_model``       ``ChatModel`` (chat endpoints): OpenAI chat fields at the top level
``common``           what they share: the engine client's life cycle (``EngineBacked``), messages, tool calls, usage
``spec``             ``FlavorSpec`` (a flavour's row) and the log-time constants; no MLflow import
``table``            ``FLAVORS`` (built from the flavour modules' ``SPEC``) and ``flavor_of``

A flavour module holds everything that is that flavour's own: its ``SPEC``, its parameter mapping (shared
validation: :mod:`model_code.params`), its conversions and trace reducers, its class, and, last, the
``set_model`` MLflow runs when it executes the file (``spec.executed_by_mlflow``; importing it never does).
Each class:

- starts the engine (or connects to a URL) in ``load_context`` from ``context.model_config`` and the
  weights in ``context.artifacts`` (nothing is started while MLflow logs the model);
- maps its interface's parameters to the engine request;
- converts engine completions / chunks to its interface's types (role ``assistant``, the final
  ``finish_reason``, usage, tool calls);
- yields stream chunks that each have their interface's documented shape, so the usual loop
  (ChatModel ``chunk["choices"][0]["delta"]["content"]``, ChatAgent ``chunk["delta"]["content"]``,
  ResponsesAgent events by ``type``) never breaks; token usage comes with the final chunk / event;
- produces one MLflow trace per ``predict`` / ``predict_stream`` with inputs, outputs and usage,
  recorded after the call (:mod:`model_code.tracing`; ``mlflow.tracing``: on, off or sampled);
- has ``close()`` (stops, or stops using, its engine) and ``batch(...)`` (see :mod:`model_code.batch`).

This ``__init__`` imports nothing, so MLflow executing one flavour's file loads that flavour alone; ``table``
(which loads them all) is imported by ``log_model`` and ``load_for_serving`` when they run.
"""
