"""The OpenAI-compatible (and Anthropic-compatible) gateway in front of SGLang engines.

A map, by folder; each folder may import those listed after it, never those before (pyproject's
``[tool.importlinter]``, checked by ``tests/test_layers.py``; ``control/``, ``data/`` and ``ui/`` share a layer and
import none of each other). Every module is named under its folder (a test checks it). The hot path is marked *.

**Composition root**
  ``cli``            the ``sglang-gateway`` command (serve, launch, check, usage)
  ``server``         uvicorn and signals; ``worker`` one worker process's main; ``app`` the app factory: one state, one middleware
                     chain, ``GatewayAPI`` serving the proxied POST routes as plain ASGI ahead of FastAPI*;
                     ``lifespans`` the lifespan of each process role (the only process or a control process, a worker)

``mlflow/``          a logged MLflow model: ``serve --model-uri`` (``model_uri``), ``POST /invocations``
                     (``invocations``, streaming included)

``batches/`` (OpenAI's Files and Batches API, and Anthropic's Message Batches, run by the gateway at low priority; docs/batches.md)
  ``api``            the routes of the table's ``BATCH_ROUTES``; ``shapes`` the wire objects; ``validate`` every line
                     through a live request's guard before a batch exists
  ``anthropic``      Anthropic's Message Batches (``/v1/messages/batches``): a create written as an input file of
                     ``/v1/messages`` lines, the batch object, list and results as views of the same batch and lines;
                     ``json_items`` its body read a request at a time as it arrives (memory bounded by one request)
  ``files``          the files' bytes (one small interface: state_dir, or the database for shared replicas); ``store``
                     files, batches, lines in the ledger's database, and each batch's lease (one replica runs it);
                     ``calls`` every call of that database, in threads of its own, bounded on PostgreSQL (a hung
                     server answers 503 at the deadline)
  ``runner``         the queued lines, bounded and retried, resumed at start, of the batches it holds the lease of;
                     ``results`` the output and error files; ``yielding`` fewer lines of a model while it serves
                     interactive requests
  ``dispatch``       the one adapter into the data plane (a line is a request of its key at the batch class);
                     ``service`` the parts put together for the app
  ``cli``            ``sglang-gateway batch``: a JSONL file submitted to a running gateway and watched (the ``openai`` SDK)

``control/`` (engines coming and going)
  ``controller``     boot, reload, swap and drain on request (admin API, SIGHUP, file watch), and supervision
  ``applier``        makes a deployment the one in force: boot applies it to an empty registry, a reload the
                     new file to the current one (``reload``: what changed, a pure function of the two files)
  ``residency``      engines that start on a model's first request and stop when idle (groups sharing GPUs)
  ``adapters``       LoRA adapters a reload adds or removes, loaded and unloaded in the running engines;
                     ``engine_api`` the engines' admin calls (memory saver, adapters), off the request path
  ``swap``           switches a model's backends (blue-green / rolling / stop-first, restarts, its router's list)
  ``fleet``          the engine and router processes: the only code that starts or stops them; ``drain``
                     waits until no request uses an old backend, then retires it
  ``watchdog``       restarts dead or unhealthy engines with backoff
  ``admin``          the admin API and its reports; ``usage_routes`` ``GET /admin/usage`` (the ledger's totals)
  ``workers``        the worker processes (started, fed the routing state, restarted, stopped): ``snapshot``
                     the routing state they get, ``channel`` how it travels, ``worker_link`` a worker's end

``data/`` (every request)
  ``routes``         the FastAPI routes made from the route table, stored responses by id, models, health, ready
  ``proxy``          a request's stages in order*: ``admission`` (checks, ``grammar_costs`` what its grammars cost
                     the engine to compile, its model's slot), ``exchange`` (a replica,
                     one retry elsewhere; ``upstream_send`` the bytes there and back), ``answer`` (plain JSON or the
                     relay); ``lease`` what a request holds*; ``waking`` a stream for an asleep model, kept alive while
                     its engine starts
  ``relay``          the SSE relay, event by event: usage, errors and Responses ids inspected, endings judged*;
                     ``event_scan`` its byte scans of a read (in C where ``_relay_loop.c`` is built)
  ``stream_pool``    the keep-alive upstream connections, parsed in the socket's callbacks: streams relayed as they
                     come, plain answers read whole (a pool each)*;
                     while the process falls behind, each stream rests after a read as its lag says (``loop_lag``)
  ``native_streams`` a stream past its first events relayed by a native thread (``_relay_loop.c``: read, cut,
                     scan, write in C), handing back to Python what must be read, a slow client and the end
  ``upstream_session`` the aiohttp session of calls off the request path; ``upstream_errors`` transport failures -> errors
  ``answer_extensions`` SGLang's fields in a plain answer that the SDKs' response models refuse, taken out
  ``prompt_count``   a cut stream's prompt, counted by the engine's tokenizer; ``usage_request`` what a request may
                     cost, and the usage asked of every stream
  ``balancer``       which replica takes a request (least in flight, or prompt-prefix affinity)*

``ui/`` (the status page and playground: static files, no build step)
  ``routes``         ``/`` and ``/ui/<name>``, served without a key (the page holds no data)

``edge/`` (a client's connection)
  ``listener``       the listening socket: every waiting connection accepted per pass of the loop (uvloop takes one)
  ``ticks``          uvicorn's server ticking once a second (not ten times), woken at once to stop
  ``connection``     uvicorn's HTTP protocol with connection/header limits and timeouts*; ``cycle`` its request-response
                     cycle, the response start checked in two searches, not two per header, and the client's leaving
                     told to what waits on it (a stream's relay, a plain request) without a task
  ``middleware``     request id + log line + metrics, body size/time cap, CORS*; ``auth`` the key check (and which key)*;
                     ``forwarded`` uvicorn's X-Forwarded-* handling, asked only of a request that carries one*
  ``quota``          a named key over its limits gets 429 with the rate-limit headers; charges its tokens*

``tenants/`` (keys that mean tenants)
  ``keys``           client keys by SHA-256 -> tenants (name, models, limits, priority class)
  ``priority``       the classes a key's holder may pick per request (``x-gateway-priority``), and the refusals
  ``quotas``         per-key buckets and budgets on an injected clock; summed over worker processes*;
                     ``shared_quotas`` summed over replicas too, exchanged through the shared store every round
  ``ledger``         the usage ledger: one row per request, buffered, written in batches off the event loop*;
                     ``ledger_schema`` its tables and versioned schema (SQLite or PostgreSQL); ``usage_query`` totals;
                     ``batch_schema`` the batch API's tables, in the same database

``core/`` (what both planes read)
  ``state``          ``GatewayState``: settings, registry, metrics, proxy, probes, quarantine, responses index
  ``registry``       names and aliases -> routes, replaced in one assignment; ``backends`` one class per kind
                     of upstream (an engine we launched, a URL, SGLang's router)
  ``endpoints``      the route table: one line per proxied route (dialect, streaming, token-id fields);
                     its request schemas are the request guard's (bodies go upstream as sent, only ``model`` rewritten)*
  ``limits``         per-model concurrency and a queue by priority class*; ``poison`` requests that crash engines*
  ``errors``         errors in the route's dialect (OpenAI or Anthropic), sanitized (``client_mistakes``: engine
                     500s that are the request's fault)
  ``health``         every probe of a backend, on a client of its own; ``metrics`` the Prometheus series
                     (``metrics_scope``: what of ``/metrics`` a client key may read; ``request_tally``: the
                     per-request series, added in batches)
  ``events``         the last reloads, swaps and restarts, for people to read (status page, admin API)
  ``responses_index`` which engine stored which Responses API response, and which key owns it (in ``state_dir``)
  ``call``           one proxied request as its stages carry it, and the hook they note its trace in*;
  ``shared_store``   the PostgreSQL store replicas share (``gateway.replicas.shared``): its tables, whether it answers,
                     its rounds; what goes through it: ``shared_responses`` (stored responses, looked up on a local
                     miss), ``shared_quarantine`` (refused shapes, pushed on change and pulled each round);
                     ``bounded_calls`` every database call under a deadline, its connections cut past it (a frozen
                     server never stalls a replica)
  ``headers``        a request's headers as one map, built once, that every layer looks its headers up in*
  ``context``        what is learnt about one request (for its log line, metrics and trace); ``tracing`` its
                     OpenTelemetry spans, built once it is over

**Tables everything reads**: ``config`` the ``gateway:`` section; ``console`` the log format of every process.
Beside ``console``, importing nothing of the gateway: ``gc_freeze``, start-up's heap frozen out of the cyclic collector
once the server serves.

**Below the gateway**: ``engine_guard/`` (a package of its own, shared with the MLflow wrapper ``model_code``): the
allowlist (``fields``, ``schemas``), request bounds and grammar checks, token ids against the vocabulary, and
request shapes (what the quarantine refuses); ``_walk.c`` its two walks over a whole body (nesting depth, shape) in C,
the Python definitions where it is not built. ``routes`` and ``proxy`` run it on every request*.
"""
