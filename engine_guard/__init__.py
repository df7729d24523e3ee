"""The request guard: what a request may carry to an SGLang engine, checked before it is sent.

One place for both ways a request reaches an engine: the gateway's proxied routes and the MLflow
wrapper's ``predict`` calls (``model_code``). It imports neither (pyproject's ``[tool.importlinter]``).

  ``fields``          the engine's request fields: allowed, dropped, refused, and the extensions off unless enabled
  ``schemas``         each route's request schema (the allowlist, types, static bounds); ``parse_body``/``check_body``
  ``bounds``          configurable bounds of one request (fan-out, grammar sizes): ``RequestBounds``, ``check_bounds``
  ``compile_budget``  what a request's grammars cost the engine to compile, measured (a probe) and refused past a budget
  ``grammar_checks``  grammar inputs the engine would crash or freeze on (a ``stop_regex`` that backtracks, bad schemas)
  ``stop_regex``      which ``stop_regex`` patterns Python's backtracking ``re`` searches in linear time, and why
  ``empty_inputs``    inputs that become a forward pass over no token (an empty score item with no query...)
  ``token_ids``       token ids outside the model's vocabulary (they crash SGLang 0.5.23's scheduler)
  ``shapes``          a request's shape: how a request that took an engine down is recognised when it comes again
  ``refusal``         ``Refused``, the one error every check raises (each caller answers it in its own terms)
"""
