"""The batch API: OpenAI's Files and Batches, and Anthropic's Message Batches, on the engines the gateway supervises
(docs/batches.md).

``api``       the routes of :data:`gateway.core.endpoints.BATCH_ROUTES` (files, batches, cancel, /admin/batches)
``anthropic`` Anthropic's Message Batches: the same batches, created from a JSON body and read in Anthropic's shapes
``shapes``    the wire objects (a file, a batch, an output line), pydantic
``files``     where files' bytes are kept (the state directory; one small interface)
``store``     files, batches and their lines in the usage ledger's database (SQLite or PostgreSQL)
``validate``  an input file checked line by line with a live request's guard, before anything is created
``dispatch``  the one adapter into the data plane: a line sent through the live request path, as its key, at low priority
``runner``    runs the queued lines (bounded, retried through passing failures), resumes after a restart, finalizes
``results``   output and error files from the lines' answers
``service``   the parts put together for the app (opened and closed by its lifespan)
"""
