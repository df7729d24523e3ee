"""The OpenAI-compatible (and Anthropic-compatible) gateway in front of SGLang engines.

A map, by plane:

**Data plane** (every request; the hot path is marked *)
  ``app``            the app factory; ``GatewayAPI`` serves the proxied POST routes as plain ASGI ahead of FastAPI*
  ``http_protocol``  uvicorn's HTTP protocol with connection/header limits and timeouts*
  ``middleware``     request id + log line + metrics, body size/time cap, CORS*; ``auth`` the key check (and which key)*
  ``endpoints``      the route table: one line per proxied route (dialect, streaming, token-id fields)
  ``routes``         the FastAPI routes made from it, stored responses by id, models, health, ready, metrics
  ``protocol``       request validation (bodies go upstream as sent, only ``model`` rewritten)*
  ``proxy``          admission, forwarding, SSE relay event by event, usage and error inspection*
  ``balancer``       which replica takes a request (least in flight, or prompt-prefix affinity)*
  ``limits``         per-model concurrency and queue*; ``poison`` requests that crash engines*
  ``errors``         errors in the route's dialect (OpenAI or Anthropic), sanitized
  ``responses_index`` which engine stored which Responses API response, and which key owns it (in ``state_dir``)
  ``context``        what is learnt about one request (for its log line); ``metrics`` the Prometheus series
  ``invocations``, ``model_uri``  ``POST /invocations`` and ``serve --model-uri`` for a logged MLflow model

**Shared state**: ``state.GatewayState`` (settings, registry, metrics, proxy, probes, quarantine,
responses index), read by both planes; ``registry`` maps names and aliases to routes and backends,
replaced in one assignment.

**Control plane** (engines coming and going)
  ``control``        boot, reload, swap and drain: boot applies the deployment to an empty registry,
                     a reload applies the new file to the current one (``reload.plan_reload``)
  ``swap``           starts, switches, drains and stops backends (blue-green / stop-first); owns the engines
  ``watchdog``       restarts dead or unhealthy engines with backoff
  ``health``         every probe of a backend, on a client of its own
  ``admin``          the admin API and its reports; ``config`` the ``gateway:`` section; ``server`` uvicorn;
                     ``cli`` the ``sglang-gateway`` command (serve, launch, check)
"""
