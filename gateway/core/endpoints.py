"""The table of every route the gateway serves: one line per route, read by everything that cares.

The hot path (:class:`gateway.app.GatewayAPI`) dispatches proxied POSTs by this table; the FastAPI routes
(and so ``/openapi.json``) are generated from it; authentication reads each route's dialect (Anthropic
clients send ``x-api-key``); metrics label requests with the route's path; the endpoint table of docs/serving.md is
checked against :func:`endpoint_table`. Adding a model-serving route of the engine is one line in
:data:`PROXIED` (plus a request schema in :mod:`engine_guard.schemas` and its test).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from engine_guard import schemas
from engine_guard.token_ids import CHAT_TOKEN_ID_FIELDS
from gateway.core.errors import Dialect, StreamKind


class ModelChoice(StrEnum):
    """How a request picks its model."""

    BODY = "body"  # the body's "model" (a name or alias), required
    BODY_OR_DEFAULT = "body_or_default"  # the body's "model", else the default model
    DEFAULT = "default"  # always the default model, whatever the body says (a serving platform's fixed route)


@dataclass(frozen=True)
class ProxiedRoute:
    """A model-serving route of the engine, proxied to the backend of the request's model."""

    path: str
    schema: type[schemas.Loose]
    summary: str
    serves: str  # which kind of model answers it, for docs/serving.md
    dialect: Dialect = Dialect.OPENAI
    stream: StreamKind | None = StreamKind.DATA  # None: never streams
    token_ids: tuple[str, ...] = ()  # body fields that carry token ids: lists, lists of lists, or a dict keyed by ids (checked against the vocabulary)
    model: ModelChoice = ModelChoice.BODY
    response_ids: bool = False  # records the ids of the responses it creates (GET /v1/responses/{id}...)
    upstream: str | None = None  # the engine's path, when not ``path``
    renames_model: bool = False  # the engine's answer names the model by its weights' path: the served name instead
    # the engine's plain answer carries SGLang fields the SDKs' models refuse: taken out (gateway.data.answer_extensions)
    sdk_strict: bool = False

    @property
    def upstream_path(self) -> str:
        return self.upstream or self.path


CHAT_COMPLETIONS = "/v1/chat/completions"  # the chat route's path: named where other modules single it out
MESSAGES = "/v1/messages"  # the Anthropic Messages route's path (and the prefix of its dialect)

PROXIED: tuple[ProxiedRoute, ...] = (
    ProxiedRoute(
        CHAT_COMPLETIONS, schemas.ChatCompletionRequest, "Chat completions (OpenAI)", "generation", token_ids=CHAT_TOKEN_ID_FIELDS,
        sdk_strict=True,
    ),
    ProxiedRoute(
        "/v1/completions", schemas.CompletionRequest, "Text completions (OpenAI)", "generation", token_ids=("prompt", "logit_bias"),
        sdk_strict=True,
    ),
    ProxiedRoute(
        "/v1/responses", schemas.ResponsesRequest, "Responses API (OpenAI), stateful with the engine's response store",
        "generation", stream=StreamKind.RESPONSES, response_ids=True,
    ),
    ProxiedRoute(
        MESSAGES, schemas.MessagesRequest, "Messages (Anthropic)", "generation",
        dialect=Dialect.ANTHROPIC, stream=StreamKind.ANTHROPIC,
    ),
    ProxiedRoute(
        "/v1/messages/count_tokens", schemas.CountTokensRequest, "Count the tokens of a Messages request (Anthropic)",
        "generation", dialect=Dialect.ANTHROPIC, stream=None,
    ),
    ProxiedRoute(
        "/v1/embeddings", schemas.EmbeddingRequest, "Embeddings (OpenAI)", "embedding", stream=None, token_ids=("input",),
        renames_model=True,
    ),
    ProxiedRoute("/v1/tokenize", schemas.TokenizeRequest, "Text or messages to token ids", "any", stream=None, model=ModelChoice.BODY_OR_DEFAULT),
    ProxiedRoute(
        "/v1/detokenize", schemas.DetokenizeRequest, "Token ids to text", "any", stream=None, token_ids=("tokens",),
        model=ModelChoice.BODY_OR_DEFAULT,
    ),
    ProxiedRoute(
        "/v1/score", schemas.ScoreRequest, "Label-token probabilities of query + items", "generation or classifier",
        stream=None, token_ids=("query", "items", "label_token_ids"), model=ModelChoice.BODY_OR_DEFAULT,
    ),
    ProxiedRoute("/v1/rerank", schemas.RerankRequest, "Rank documents against a query", "reranker / embedding", stream=None, model=ModelChoice.BODY_OR_DEFAULT),
    ProxiedRoute(
        "/v1/classify", schemas.ClassifyRequest, "Classify inputs", "sequence classifier", stream=None, token_ids=("input",),
        model=ModelChoice.BODY_OR_DEFAULT,
    ),
)  # fmt: skip

PROXIED_BY_PATH: dict[str, ProxiedRoute] = {route.path: route for route in PROXIED}

# Served only when the gateway serves a YAML (not with --model-uri, which has an /invocations of its own):
# where Databricks custom LLM serving forwards each endpoint request, an OpenAI chat body whose "model"
# (absent, or the endpoint's name) does not choose the model.
INVOCATIONS = ProxiedRoute(
    "/invocations", schemas.InvocationsRequest, "Chat completions of the default model (a serving platform's route)",
    "generation", model=ModelChoice.DEFAULT, upstream=CHAT_COMPLETIONS, token_ids=CHAT_TOKEN_ID_FIELDS, sdk_strict=True,
)  # fmt: skip

# Responses stored by the engine, reached through the engine that created them (see gateway.core.responses_index).
RESPONSE_BY_ID = "/v1/responses/{response_id}"
RESPONSE_CANCEL = "/v1/responses/{response_id}/cancel"

# The batch API (gateway.batches.api serves exactly these; its handlers are looked up by (method, path)).
FILES = "/v1/files"
FILE_BY_ID = "/v1/files/{file_id}"
FILE_CONTENT = "/v1/files/{file_id}/content"
BATCHES = "/v1/batches"
BATCH_BY_ID = "/v1/batches/{batch_id}"
BATCH_CANCEL = "/v1/batches/{batch_id}/cancel"
ADMIN_BATCHES = "/admin/batches"
# Anthropic's Message Batches, a dialect over the same batches (gateway.batches.anthropic)
MESSAGE_BATCHES = "/v1/messages/batches"
MESSAGE_BATCH_BY_ID = "/v1/messages/batches/{message_batch_id}"
MESSAGE_BATCH_CANCEL = "/v1/messages/batches/{message_batch_id}/cancel"
MESSAGE_BATCH_RESULTS = "/v1/messages/batches/{message_batch_id}/results"
BATCH_ROUTES: tuple[tuple[str, str, str], ...] = (
    ("POST", FILES, "Upload a batch input file (multipart, purpose=batch, JSONL)"),
    ("GET", FILES, "The caller's files"),
    ("GET", FILE_BY_ID, "One file"),
    ("DELETE", FILE_BY_ID, "Delete a file"),
    ("GET", FILE_CONTENT, "A file's bytes (an input, output or error file)"),
    ("POST", BATCHES, "Create a batch from an uploaded file (every line checked first)"),
    ("GET", BATCHES, "The caller's batches, newest first (after, limit)"),
    ("GET", BATCH_BY_ID, "One batch, with its request counts"),
    ("POST", BATCH_CANCEL, "Cancel a batch: no new line starts"),
    ("GET", ADMIN_BATCHES, "Every key's batches (admin key)"),
    ("POST", MESSAGE_BATCHES, "Create a Message Batch (Anthropic): its requests checked first"),
    ("GET", MESSAGE_BATCHES, "The caller's Message Batches, newest first (before_id, after_id, limit)"),
    ("GET", MESSAGE_BATCH_BY_ID, "One Message Batch, with its request counts"),
    ("DELETE", MESSAGE_BATCH_BY_ID, "Delete an ended Message Batch and its results"),
    ("POST", MESSAGE_BATCH_CANCEL, "Cancel a Message Batch: no new request starts"),
    ("GET", MESSAGE_BATCH_RESULTS, "An ended Message Batch's results (JSONL, in request order)"),
)

# Served by the gateway itself: (method, path, summary), for docs/serving.md and the metrics labels.
GATEWAY_ROUTES: tuple[tuple[str, str, str], ...] = (
    *BATCH_ROUTES,
    ("GET", RESPONSE_BY_ID, "A stored response, from the engine that created it"),
    ("POST", RESPONSE_CANCEL, "Cancel a background response, on the engine that runs it"),
    ("GET", "/v1/models", "The models and aliases, with context lengths"),
    ("GET", "/v1/models/{model}", "One model"),
    ("GET", "/health", "Liveness of the gateway (HEAD too)"),
    ("GET", "/ready", "200 when every model's engine is healthy, else 503 naming the ones that are not (HEAD too)"),
    ("GET", "/metrics", "Prometheus metrics"),
    ("GET", "/", "The status page and playground, for a browser (`gateway.status_page`)"),
)
ADMIN_PREFIX = "/admin/"
STATUS_PAGE = "/"
UI_PREFIX = "/ui/"  # the status page's scripts and styles


def listening_note(host: str, port: int, status_page: bool) -> str:
    """``http://host:port``, and where a browser finds the status page (what the "listening" log line says)."""
    url = f"http://{host}:{port}"
    if not status_page:
        return url
    browse = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"{url} (status page and playground: http://{browse}:{port}{STATUS_PAGE})"


def is_status_page(path: str) -> bool:
    """The page and its files: static, no secrets in them, so served without a key (what they fetch needs one)."""
    return path == STATUS_PAGE or path.startswith(UI_PREFIX)


def dialect_for_path(path: str) -> Dialect:
    """The error dialect of ``path`` (also for paths that are not routes: /v1/messages/anything is Anthropic's)."""
    route = PROXIED_BY_PATH.get(path)
    if route is not None:
        return route.dialect
    return Dialect.ANTHROPIC if path.startswith(MESSAGES) else Dialect.OPENAI


def route_label(path: str) -> str:
    """The bounded ``route`` label of ``path`` for metrics (ids and model names folded)."""
    if path in PROXIED_BY_PATH or path in _GATEWAY_PATHS or path == INVOCATIONS.path:
        return path
    if path.startswith("/v1/responses/"):
        return RESPONSE_CANCEL if path.endswith("/cancel") else RESPONSE_BY_ID
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith(("/v1/files/", "/v1/batches/")):  # ids folded
        return _batch_label(path)
    if path.startswith(MESSAGE_BATCHES + "/"):
        return _message_batch_label(path)
    if path.startswith(ADMIN_PREFIX):
        return "/admin"  # one label for the admin API (its paths carry model names)
    if path.startswith(UI_PREFIX):
        return "/ui"
    return "other"


_GATEWAY_PATHS = frozenset(path for _, path, _ in GATEWAY_ROUTES if "{" not in path)

# A client's management of its own batches and files: no generation, so none of the key's generation limits
# (gateway.edge.quota gives them a modest limit of their own)
_MANAGEMENT = frozenset({
    FILES, FILE_BY_ID, FILE_CONTENT, BATCHES, BATCH_BY_ID, BATCH_CANCEL,
    MESSAGE_BATCHES, MESSAGE_BATCH_BY_ID, MESSAGE_BATCH_CANCEL, MESSAGE_BATCH_RESULTS,
})  # fmt: skip


def is_batch_management(path: str) -> bool:
    """Whether ``path`` is a client's call on its batches or files (listing, creating, reading, cancelling, deleting)."""
    return route_label(path) in _MANAGEMENT


def _batch_label(path: str) -> str:
    parts = path.strip("/").split("/")  # v1, files|batches, id[, content|cancel]
    if len(parts) == 3:
        return FILE_BY_ID if parts[1] == "files" else BATCH_BY_ID
    if len(parts) == 4 and (parts[1], parts[3]) in (("files", "content"), ("batches", "cancel")):
        return FILE_CONTENT if parts[1] == "files" else BATCH_CANCEL
    return "other"


def _message_batch_label(path: str) -> str:
    parts = path.strip("/").split("/")  # v1, messages, batches, id[, cancel|results]
    if len(parts) == 4:
        return MESSAGE_BATCH_BY_ID
    if len(parts) == 5 and parts[4] in ("cancel", "results"):
        return MESSAGE_BATCH_CANCEL if parts[4] == "cancel" else MESSAGE_BATCH_RESULTS
    return "other"


def endpoint_table() -> str:
    """The endpoint table of docs/serving.md (a test checks that page holds exactly this)."""
    lines = ["| Method and path | What it does | Model kind |", "|---|---|---|"]
    lines += [f"| `POST {route.path}` | {route.summary} | {route.serves} |" for route in (*PROXIED, INVOCATIONS)]
    lines += [f"| `{method} {path}` | {summary} | – |" for method, path, summary in GATEWAY_ROUTES]
    return "\n".join(lines)
