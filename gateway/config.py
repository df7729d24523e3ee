"""The ``gateway:`` section of the deployment YAML, validated here (``launch`` keeps it opaque).

Errors read like every other config error: ``file: gateway.port: reason`` (:class:`ConfigError`).
API keys may come from the YAML, an environment variable or a file; they are resolved once, at load
time, so a missing variable or file fails the start, not the first request.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from engine_guard.bounds import RequestBounds
from engine_guard.fields import EXTENSIONS
from launch.config import (
    GATEWAY_KEY_FILE_SETTINGS,
    GATEWAY_PER_MODEL_SETTINGS,
    ConfigError,
    DeploymentConfig,
    format_validation_error,
)
from launch.reference import settings_table

OpenPath = Literal["/health", "/ready", "/metrics"]
SwapPolicy = Literal["auto", "blue-green", "stop-first", "rolling"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitSettings(_Strict):
    """Per-model admission control: at most ``max_concurrent`` requests upstream, ``max_queue`` waiting."""

    max_concurrent: int | None = Field(None, ge=1, description="Concurrent requests per model (unset: no limit).")
    max_queue: int = Field(0, ge=0, description="Requests that may wait for a slot; 0 answers 429 at once.")
    max_concurrent_grammars: int | None = Field(
        4, ge=1, description="Requests with a heavy grammar being compiled by the engine at once; beyond, they wait up to queue_timeout_s (unset: no limit)."
    )
    heavy_grammar_bytes: int = Field(
        2048, ge=0, description="A request whose grammars (regex, ebnf, JSON schemas, forced tools) total this many bytes takes a grammar slot."
    )
    queue_timeout_s: float = Field(
        30.0, gt=0, description="How long a queued request waits for a slot before 429 (not a wait for a "
        "[residency](residency.md) cold start: that is bounded by the engine's startup_timeout_s).",
    )  # fmt: skip
    retry_after_s: int = Field(1, ge=0, description="Retry-After header sent with 429 and 503.")


class WatchdogSettings(_Strict):
    """Supervision of the engines the gateway launched: restart dead or unhealthy ones, with backoff."""

    enabled: bool = Field(True, description="Watch managed engines and restart them.")
    interval_s: float = Field(5.0, gt=0, description="Seconds between two checks of each engine.")
    unhealthy_after: int = Field(
        3, ge=1, description="Consecutive failed /health probes before a restart; a probe failed while the engine's work counters advanced does not count (busy, not frozen)."
    )
    progress_timeout_s: float = Field(
        5.0, gt=0, description="Timeout of each read of the engine's work counters (its /metrics): beside each /health probe, and once more after a failed one."
    )
    backoff_initial_s: float = Field(1.0, ge=0, description="Delay before the first restart attempt.")
    backoff_max_s: float = Field(60.0, ge=0, description="Longest delay between two restart attempts.")
    max_restarts: int | None = Field(
        None, ge=0, description="Failed restarts in a row before giving up (unset: never give up, retry every backoff_max_s)."
    )
    stable_after_s: float = Field(60.0, ge=0, description="Healthy this long after a restart resets the backoff.")
    suspect_linger_s: float = Field(
        60.0, ge=0, description="How long a request that left before its answer stays a suspect of a freeze when its engine "
        "work can outlive it (a grammar compile, a long prompt's prefill).",
    )  # fmt: skip


class BalancingSettings(_Strict):
    """How requests of a model with replicas are spread over them."""

    policy: Literal["least_in_flight", "prefix_affinity"] = Field(
        "least_in_flight", description="least_in_flight, or prefix_affinity: requests sharing a prompt prefix go to one replica."
    )
    prefix_chars: int = Field(2048, ge=16, description="Characters of the prompt's beginning that choose the replica (prefix_affinity).")
    max_imbalance: int = Field(
        4, ge=0, description="prefix_affinity yields to the least busy replica when its own has this many more requests in flight."
    )
    min_ready: int = Field(1, ge=1, description="/ready is 200 while at least this many replicas of the model are healthy.")


class KeyLimits(_Strict):
    """What one named key may use (each unset: no limit). Tokens are prompt + completion as the engine reports them,
    charged when the request ends: a request is admitted while the key has tokens left, and may end past the limit."""

    requests_per_minute: int | None = Field(None, ge=1, description="Requests per minute (a bucket refilled continuously).")
    tokens_per_minute: int | None = Field(None, ge=1, description="Prompt + completion tokens per minute (refilled continuously).")
    max_concurrent: int | None = Field(None, ge=1, description="Requests of this key in flight at once.")
    tokens_per_day: int | None = Field(None, ge=1, description="Token budget per UTC day.")
    tokens_per_month: int | None = Field(None, ge=1, description="Token budget per UTC calendar month.")
    batch_file_bytes: int | None = Field(None, ge=1, description="Bytes of batch files (uploads and batches' results) the key may keep (uploads beyond: 413).")
    batch_files: int | None = Field(None, ge=1, description="Batch files (uploads and batches' results) the key may keep (uploads beyond: 413).")


FILE_LIMITS = frozenset({"batch_file_bytes", "batch_files"})  # storage, checked by the batch API: not request limits


_KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MIN_CLASS, MAX_CLASS = -1000, 1000  # priority classes (SGLang's priority is any int32; a smaller range reads better)
_CLASS_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")  # starts with a letter: never read as a number
_CLASS_NUMBER = re.compile(r"^[+-]?[0-9]{1,4}$")


def class_number(value: int | str, classes: Mapping[str, int]) -> int | None:
    """The priority class ``value`` stands for: a number in range (or its digits), or a name of ``classes``
    (``gateway.priority_classes``); None when it is neither."""
    if isinstance(value, str):
        if value in classes:
            return classes[value]
        if not _CLASS_NUMBER.match(value):
            return None
        value = int(value)
    return value if MIN_CLASS <= value <= MAX_CLASS else None


def _class_value(value: object) -> object:
    """A priority class as the YAML gives it: a number in range or a name (which classes exist is checked with the
    whole section); one message for anything else (pydantic's union would give one line per member)."""
    if isinstance(value, bool) or not isinstance(value, int | str) or (isinstance(value, int) and not MIN_CLASS <= value <= MAX_CLASS):
        raise ValueError(f"a priority class is a number from {MIN_CLASS} to {MAX_CLASS} or a name of gateway.priority_classes (got {value!r})")
    return value


class NamedKey(_Strict):
    """A client key that names its holder (a tenant): the models it may use and its limits."""

    name: str = Field(description="The tenant: what the log, the metrics and the usage ledger call it.")
    key: SecretStr | None = Field(None, description="The key itself (or key_env, or key_sha256).")
    key_env: str | None = Field(None, description="Environment variable holding the key.")
    key_sha256: str | None = Field(None, description="SHA-256 of the key, hex (sglang-gateway hash-key prints it): the key is never stored.")
    models: list[str] | None = Field(None, description="Models (names or aliases) it may use; others answer 404 as if absent (unset: all).")
    limits: KeyLimits = Field(default_factory=KeyLimits, description="Its limits.")
    priority: int | str | None = Field(
        None,
        description="Priority class (-1000..1000, or a name of gateway.priority_classes): higher is admitted first from a "
        "model's queue, and sent as the request's priority to an engine that schedules by it (enable_priority_scheduling) "
        "(unset: 0 in the queue, the request's own priority upstream).",
    )
    allowed_priorities: list[int | str] | None = Field(
        None,
        description="Classes its holder may pick per request with the x-gateway-priority header (numbers or names of "
        "gateway.priority_classes); its own priority is always one of them (unset: the header is refused).",
    )

    @field_validator("name")
    @classmethod
    def _good_name(cls, value: str) -> str:
        if not _KEY_NAME.match(value):
            raise ValueError(f"a key name is 1-64 letters, digits and . _ @ - (got {value!r})")
        return value

    @field_validator("priority", mode="before")
    @classmethod
    def _priority_value(cls, value: object) -> object:
        return value if value is None else _class_value(value)

    @field_validator("allowed_priorities", mode="before")
    @classmethod
    def _allowed_values(cls, value: object) -> object:
        if isinstance(value, list):
            if not value:
                raise ValueError("list at least one class (or leave allowed_priorities out: the header is then refused)")
            for item in value:
                _class_value(item)
        return value

    def priority_classes(self) -> list[tuple[str, int | str]]:
        """(setting, class) of every class this key names: its own, then the ones its holder may pick."""
        own = [("priority", self.priority)] if self.priority is not None else []
        return own + [("allowed_priorities", value) for value in self.allowed_priorities or ()]

    @field_validator("key_sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        if value is not None and not _SHA256.match(value.lower()):
            raise ValueError("key_sha256 must be 64 hex digits (the SHA-256 of the key)")
        return value.lower() if value is not None else None

    def digest(self, source: str, where: str) -> bytes:
        """SHA-256 of the key, from whichever of key / key_env / key_sha256 gives it (exactly one must)."""
        given = [name for name in ("key", "key_env", "key_sha256") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ConfigError(f"{source}: {where}: give exactly one of key, key_env, key_sha256 (got {', '.join(given) or 'none'})")
        if self.key_sha256 is not None:
            return bytes.fromhex(self.key_sha256)
        if self.key_env is not None:
            value = os.environ.get(self.key_env, "").strip()
            if not value:
                raise ConfigError(f"{source}: {where}.key_env: environment variable {self.key_env} is not set")
            return hashlib.sha256(value.encode()).digest()
        assert self.key is not None
        value = self.key.get_secret_value().strip()
        if not value:
            raise ConfigError(f"{source}: {where}.key: must not be empty")
        return hashlib.sha256(value.encode()).digest()


class HttpSettings(_Strict):
    """Limits of the HTTP layer, enforced before any route runs (safe for a gateway bound to 0.0.0.0)."""

    max_connections: int = Field(
        8192, ge=1,
        description="Open client connections; beyond, new ones get 503 and are closed. Each stream holds about three file descriptors: the gateway raises its open-file limit to the hard limit at start; the default is lowered to what that limit fits (logged), an explicit value above it is warned about. A process out of descriptors anyway answers 503 gateway_out_of_descriptors naming its own limit.",
    )
    max_connections_per_key: int | None = Field(
        None, ge=1,
        description="Open client connections whose last request carried one key; beyond, that key's request on another connection gets 503 too_many_connections and it is closed, so one key cannot hold every connection (unset: half of max_connections).",
    )
    max_header_bytes: int = Field(32768, ge=1024, description="Request line plus headers; beyond: 431.")
    max_headers: int = Field(100, ge=1, description="Header fields per request; beyond: 431.")
    max_url_bytes: int = Field(8192, ge=256, description="Request target (path and query); beyond: 414.")
    header_timeout_s: float = Field(10.0, gt=0, description="From a request's first byte to its last header; beyond: 408.")
    keepalive_timeout_s: float = Field(30.0, gt=0, description="An idle connection (new or between requests) is closed after this.")
    body_timeout_s: float = Field(30.0, gt=0, description="Longest silence while a request body arrives; beyond: 408.")
    body_deadline_s: float = Field(
        60.0, gt=0, description="From a request's last header to the last byte of its body, however steadily it trickles; beyond: 408, connection closed."
    )
    write_timeout_s: float = Field(30.0, gt=0, description="A client that accepts no response bytes this long is disconnected (its stream stops, its slot is freed).")


class UsageSettings(_Strict):
    """The usage ledger: one row per request (key, model, tokens, status, latency), written off the hot path."""

    enabled: bool = Field(True, description="Write a row per request to the usage database.")
    database_url: SecretStr | None = Field(
        None,
        description="SQLAlchemy URL of the usage database: sqlite:///path or postgresql+psycopg://user:pass@host/db "
        "(unset: usage.sqlite3 under state_dir). Every worker process writes its own rows to it; a password is never logged.",
    )
    flush_interval_s: float = Field(1.0, gt=0, le=3600, description="Seconds a row waits for others before they are written together (the writer sleeps while none waits).")
    batch_rows: int = Field(500, ge=1, le=100_000, description="Rows written in one transaction; a buffer this full is written at once.")
    max_buffer_rows: int = Field(
        100_000, ge=1, description="Rows kept in memory while the database is unreachable; beyond, the oldest are dropped (counted)."
    )
    database_timeout_s: float = Field(
        5.0, gt=0, le=300,
        description="The longest one call of the usage database (and of the replicas' shared store, and of the batch database on "
        "PostgreSQL) may take, counted by the gateway: a server that does not answer in time, down or hung, counts as unreachable "
        "(the batch API answers 503 batches_unavailable). A batch create's check and insert of its lines, a batch file's write "
        "and a batch's results get 12 times it (docs/batches.md).",
    )  # fmt: skip

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        url = value.get_secret_value().strip()
        if url.startswith(("postgresql://", "postgres://")):  # psycopg 3 is the driver installed with the gateway
            url = "postgresql+psycopg://" + url.split("://", 1)[1]
        if not url.startswith(("sqlite:///", "postgresql+psycopg://")) or url in ("sqlite:///", "postgresql+psycopg://"):
            raise ValueError("database_url must be sqlite:///<path> or postgresql+psycopg://<user>@<host>/<database>")
        _parses(url)
        return SecretStr(url)


def _parses(url: str) -> None:
    """Refuse a database URL SQLAlchemy cannot read (a port that is no number...) now, not at the first query.

    The reasons are fixed words: SQLAlchemy's own messages quote the URL, password included."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except ValueError:  # int() of the port
        raise ValueError("the port after the host must be a number (host:5432)") from None
    except ArgumentError:
        raise ValueError("not a URL (driver://user:password@host:port/database)") from None


class BatchSettings(_Strict):
    """The batch API (``/v1/files``, ``/v1/batches``): jobs of many requests run in the engines' idle time."""

    enabled: bool = Field(True, description="Serve /v1/files, /v1/batches and /v1/messages/batches and run the batches (needs a state_dir or usage.database_url).")
    max_file_bytes: int = Field(100 * 1024 * 1024, ge=1024, description="Largest uploaded file, and body of a Message Batch create (413 beyond; raises max_body_bytes for POST /v1/files and /v1/messages/batches).")
    max_lines: int = Field(50_000, ge=1, description="Requests in one batch input file (400 beyond).")
    max_line_bytes: int = Field(1024 * 1024, ge=256, description="Bytes of one line of an input file (400 beyond).")
    max_concurrency: int = Field(
        4, ge=1, description="Batch lines in flight at once, over every batch: the rest wait in the gateway, not on the engine."
    )
    max_concurrency_beside_interactive: int = Field(
        1, ge=1,
        description="Batch lines of one model in flight at once while that model has other requests in flight or queued (or "
        "had, in the last second): the batch yields the engine to interactive traffic, whose latency grows with every "
        "request an engine runs beside it (on a GPU with room in its batch, raise it toward max_concurrency).",
    )  # fmt: skip
    priority: int | str | None = Field(
        None,
        description="Priority class of batch lines (in the model's queue, and on engines that schedule by priority). "
        "Unset: one below the lowest class any key or gateway.priority_classes names (and below 0).",
    )
    max_queued_lines_per_key: int = Field(200_000, ge=1, description="Lines one key may have waiting over all its batches (429 beyond).")
    max_active_batches_per_key: int = Field(20, ge=1, description="Batches of one key not yet finished (429 beyond).")
    retry_backoff_s: float = Field(1.0, gt=0, description="First wait before a line that met a passing failure (429, 502, 503, 504) is sent again.")
    poll_interval_s: float = Field(1.0, gt=0, description="How often the runner looks for batches created elsewhere (worker processes, replicas) or cancelled; a lone process on SQLite looks only when a batch is created or cancelled there, or while one is unfinished.")
    min_free_bytes: int = Field(
        256 * 1024 * 1024, ge=0,
        description="Free space the state_dir's disk keeps: an upload that would leave less is refused (507), so that batches "
        "can still record their lines and write their results, and the database its rows (0: no floor).",
    )  # fmt: skip


class ReplicaSettings(_Strict):
    """Several gateway processes (pods, hosts) behind one load balancer, sharing one state through a PostgreSQL store."""

    shared: bool = Field(
        False,
        description="This gateway is one of several replicas behind a load balancer: per-key limits and budgets, stored "
        "responses, the quarantine and batch jobs are shared through the PostgreSQL database of usage.database_url "
        "(required); its models must be url: or router upstreams (see [Scaling](scaling.md)).",
    )
    name: str | None = Field(None, description="This replica's name in the shared store (unset: the host name and process id).")
    expected: int = Field(
        2, ge=1, description="How many replicas share the load: while the store is unreachable, each keeps 1/expected of every key's limits."
    )
    sync_interval_s: float = Field(
        0.25, gt=0, le=60, description="How often a replica exchanges its per-key usage with the store (what shared limits may overshoot by)."
    )
    lease_s: float = Field(
        30.0, gt=0, description="A batch whose replica stopped renewing its lease this long ago is taken over by another replica."
    )


class TracingSettings(_Strict):
    """OpenTelemetry spans per request, exported over OTLP (off by default); the standard ``OTEL_*`` variables
    fill what is unset here (docs/tracing.md)."""

    enabled: bool = Field(False, description="Export one trace per request (a server span, its queue wait, each upstream attempt).")
    endpoint: str | None = Field(
        None,
        description="The collector: http://host:4318 (http/protobuf; a URL with a path is the full traces URL) or "
        "host:4317 (grpc). Unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT, then localhost.",
    )
    protocol: Literal["http/protobuf", "grpc"] | None = Field(
        None, description="OTLP transport (unset: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else http/protobuf)."
    )
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, description="Headers sent to the collector, e.g. an authorization token (plus OTEL_EXPORTER_OTLP_HEADERS)."
    )
    service_name: str | None = Field(None, description="service.name of the gateway's spans (unset: OTEL_SERVICE_NAME, else sglang-gateway).")
    sample_ratio: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Share of new traces recorded (unset: OTEL_TRACES_SAMPLER_ARG, else 1.0); a client's traceparent decides for its own.",
    )  # fmt: skip
    engines: bool = Field(
        False, description="Managed engines export their own spans (SGLang --enable-trace) to the same collector, under the gateway's."
    )


class ResidencyGroup(_Strict):
    """Models that share GPUs: how many of them may run at once."""

    max_resident: int = Field(1, ge=1, description="Engines of the group's models running at once.")
    turn_s: float = Field(
        300.0, gt=0, description="A member resident this long while another member's request waits for room has had its turn: "
        "it takes no new request (they wait for its next turn) and is stopped once its requests in flight end (none is cut; "
        "see [Taking turns](residency.md#taking-turns-no-key-holds-or-thrashes-a-group)).",
    )  # fmt: skip
    min_resident_s: float = Field(
        30.0, ge=0, description="An engine of the group is not stopped to make room before it has been resident this long (thrash guard)."
    )
    wakes_per_key_per_hour: int | None = Field(
        60, ge=1, description="Cold starts of the group's models one key may cause in an hour; past it, its request for an "
        "asleep member is refused with 429 wake_limit_exceeded and Retry-After (unset: no limit).",
    )  # fmt: skip


class GatewaySettings(_Strict):
    """Every key of the ``gateway:`` section."""

    host: str = Field("127.0.0.1", description="Interface to bind (--host overrides).")
    workers: int | Literal["auto"] = Field(
        "auto",
        description="Data-plane processes accepting on the port (each its own SO_REUSEPORT socket); the engines, reloads, swaps, "
        "the watchdog and the admin API stay in one control process. auto: 1 below 4 CPUs, else one per 4 CPUs, at most 8 "
        "(restart to change; see [Worker processes](serving.md#worker-processes)).",
    )
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (--port overrides).")
    api_keys: list[SecretStr] = Field(default_factory=list, description="Accepted bearer keys (none: the gateway is open).")
    api_keys_env: str | None = Field(None, description="Environment variable with comma-separated keys.")
    api_keys_file: Path | None = Field(None, description="File with one key per line (# comments), relative to the YAML.")
    open_paths: list[OpenPath] = Field(
        default_factory=lambda: ["/health", "/ready"], description="Routes reachable without a key (any of /health, /ready, /metrics)."
    )
    limits: LimitSettings = Field(default_factory=LimitSettings, description="Default per-model limits.")
    model_limits: dict[str, LimitSettings] = Field(default_factory=dict, description="Per-model overrides of limits (model name: the keys of limits).")
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1024, description="Largest request body (413 beyond).")
    upstream_connect_timeout_s: float = Field(5.0, gt=0, description="Connect timeout to an engine (504).")
    upstream_read_timeout_s: float = Field(600.0, gt=0, description="Longest wait for the next upstream bytes (504).")
    upstream_max_connections: int | None = Field(
        None, ge=1,
        description="Connections to the engines at once, per pool (plain requests, streams); beyond, a request waits up to upstream_connect_timeout_s, then 503 upstream_pool_full with Retry-After, never a 504 (kept for an engine that timed out) (unset: no cap, the engines' own limits apply).",
    )
    stream_coalesce_ms: float = Field(
        100.0, ge=0, le=1000,
        description="The longest a stream relayed in Python (relay_native off or not built, or a stream's first "
        "events) has its next read put off while this process falls behind its work. As long as "
        "it keeps up (its event loop runs timers under 5 ms late on average), every event is relayed as it comes; "
        "beyond, each stream rests after a read for 8x that lag, up to this, so that what the engine sent meanwhile "
        "goes to the client in one read and one write (a read that carries a stream's finish is followed at once): "
        "the gap this adds follows the lag the process already has. 0: every event as it comes, however far behind "
        "(restart to change; see [Serving](serving.md#many-streams-per-process-stream_coalesce_ms)).",
    )
    stream_coalesce_min_streams: int = Field(
        0, ge=0,
        description="Streams this process must relay at once before any stream may rest (0: at any count; how far "
        "behind the process is decides, see stream_coalesce_ms) (restart to change).",
    )
    relay_native: bool = Field(
        True,
        description="Relay each stream, once its first events went out, on a native thread (C, built when the package "
        "is installed) that reads, scans and writes its events off the event loop, handing back to Python only what "
        "must be read (usage, errors, Responses ids), a slow client and the end. false, or an install without the "
        "extension (the gateway says so at startup): every event through the Python relay "
        "(restart to change; see [Serving](serving.md#the-native-relay-relay_native)).",
    )
    health_timeout_s: float = Field(5.0, gt=0, description="Timeout of each /health probe made by /ready and the watchdog.")
    cors_allow_origins: list[str] = Field(default_factory=list, description="CORS origins (empty: CORS off).")
    shutdown_grace_s: float = Field(30.0, ge=0, description="In-flight requests may finish this long on SIGTERM or Ctrl-C.")
    shutdown_delay_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description="On SIGTERM, first answer /ready with 503 (`draining`) while still serving every request for this long, so "
        "that a load balancer stops sending new ones; then stop accepting and give in-flight requests shutdown_grace_s. "
        "Behind a load balancer or Kubernetes: more than its readiness period (see [Operations](operations.md)); "
        "0 (a process on its own): stop accepting at once. Ctrl-C never waits.",
    )
    log_requests: bool = Field(True, description="One structured log line per request.")
    residency_groups: dict[str, ResidencyGroup] = Field(
        default_factory=dict,
        description="[Residency groups](residency.md): models that share GPUs (`models.<name>.residency.group`), by name; "
        "applied on reload.",
    )
    status_page: bool = Field(
        True,
        description="The status page and playground at / (static files: what they show comes from the API with the keys the "
        "browser's user enters; admin parts need an admin key; see [the status page](status-page.md)). false: / answers 404.",
    )
    keys: list[NamedKey] = Field(
        default_factory=list,
        description="Named client keys (tenants), each with its models and limits "
        "(see [Named keys](tenants.md#named-keys-tenants-with-their-models-and-limits)).",
    )
    priority_classes: dict[str, int] = Field(
        default_factory=dict,
        description="Names of priority classes (name: number, -1000..1000, higher first) that keys' priority and "
        "allowed_priorities and the x-gateway-priority header may use in place of the number, e.g. {batch: -1, interactive: 5}; "
        "applied on reload (see [Tenants](tenants.md#choosing-a-class-per-request)).",
    )
    keys_env: str | None = Field(None, description="Environment variable holding more named keys: a JSON or YAML list like keys.")
    keys_file: Path | None = Field(None, description="YAML file with more named keys (a list like keys; each gives key_sha256, not the key).")
    admin_keys: list[SecretStr] = Field(default_factory=list, description="Bearer keys of the /admin API (none: it is off).")
    admin_keys_env: str | None = Field(None, description="Environment variable with comma-separated admin keys.")
    admin_keys_file: Path | None = Field(None, description="File with one admin key per line (# comments).")
    metrics_key: SecretStr | None = Field(
        None,
        description="Bearer key that reads all of /metrics (as the admin keys do) on a gateway with client keys: Prometheus' "
        "key (its authorization block); client keys read only their own part (see [Security](security.md#metrics)).",
    )
    metrics_key_env: str | None = Field(None, description="Environment variable holding the metrics key.")
    metrics_key_file: Path | None = Field(None, description="File holding the metrics key (# comments).")
    drain_timeout_s: float = Field(60.0, ge=0, description="How long a replaced engine may finish its requests.")
    swap_default: SwapPolicy = Field(
        "auto", description="How engines are replaced when their config changes (auto: blue-green, or rolling for replicas)."
    )
    swap_policy: dict[str, SwapPolicy] = Field(default_factory=dict, description="Per-model swap policy overrides.")
    swap_retry_after_s: int = Field(5, ge=0, description="Retry-After sent while a stop-first swap has a model down.")
    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings, description="Engine supervision.")
    http: HttpSettings = Field(default_factory=HttpSettings, description="Connection and header limits, timeouts.")
    balancing: BalancingSettings = Field(default_factory=BalancingSettings, description="Spreading requests over replicas.")
    model_balancing: dict[str, BalancingSettings] = Field(default_factory=dict, description="Per-model overrides of balancing.")
    request_bounds: RequestBounds = Field(default_factory=RequestBounds, description="Fan-out and grammar bounds of one request (see [Bounds](security.md#request-bounds)).")
    usage: UsageSettings = Field(default_factory=UsageSettings, description="The [usage ledger](tenants.md#usage-ledger) (one row per request).")
    tracing: TracingSettings = Field(default_factory=TracingSettings, description="OpenTelemetry traces over OTLP (off by default; see [tracing.md](tracing.md)); read at start.")
    replicas: ReplicaSettings = Field(
        default_factory=ReplicaSettings, description="Replicas of this gateway sharing one state (see [Scaling](scaling.md)); read at start."
    )
    batches: BatchSettings = Field(default_factory=BatchSettings, description="The batch API: files, batches, their limits (see [Batches](batches.md)).")
    extension_fields: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Per model, the SGLang extension fields clients may send (off by default; see [SGLang extension "
        "fields](security.md#sglang-extension-fields)); an MLflow model logged from this config reads it too "
        "([the MLflow path](security.md#the-mlflow-path-the-same-guard)).",
    )
    state_dir: Path | None = Field(
        None,
        description="Where state that outlives the gateway process is kept (which key owns which stored response, on "
        "which engine, and the usage ledger), relative to the YAML. Default: "
        "`$XDG_STATE_HOME/sglang-gateway/<config name>-<hash of its path>` ($XDG_STATE_HOME: ~/.local/state); memory only "
        "for a deployment built without a file.",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _positive_workers(cls, value: object) -> object:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"workers must be a number of at least 1, or auto (got {value!r})")
        return value

    def worker_count(self) -> int:
        """How many data-plane processes serve: ``workers``, with ``auto`` sized from the CPUs this process may use."""
        if self.workers != "auto":
            return int(self.workers)
        return auto_workers(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

    @field_validator("priority_classes")
    @classmethod
    def _class_names(cls, value: dict[str, int]) -> dict[str, int]:
        for name, number in value.items():
            if not _CLASS_NAME.match(name):
                raise ValueError(f"a class name is 1-32 letters, digits, _ and -, starting with a letter (got {name!r})")
            if not MIN_CLASS <= number <= MAX_CLASS:
                raise ValueError(f"{name}: a priority class is a number from {MIN_CLASS} to {MAX_CLASS} (got {number})")
        return value

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _non_empty_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        if any(not key.get_secret_value().strip() for key in value):
            raise ValueError("API keys must not be empty")
        return value

    @field_validator("metrics_key")
    @classmethod
    def _non_empty_metrics_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("the metrics key must not be empty")
        return value

    def limits_for(self, model: str) -> LimitSettings:
        return self.model_limits.get(model, self.limits)

    def balancing_for(self, model: str) -> BalancingSettings:
        return self.model_balancing.get(model, self.balancing)

    def extensions_for(self, model: str) -> frozenset[str]:
        return frozenset(self.extension_fields.get(model, ()))

    def swap_policy_for(self, model: str) -> SwapPolicy:
        return self.swap_policy.get(model, self.swap_default)

    def resolved_keys(self, source: str = "config") -> tuple[bytes, ...]:
        """All accepted client keys (YAML, env, file) as bytes; ConfigError when a named source is missing."""
        return _resolve_keys(self.api_keys, self.api_keys_env, self.api_keys_file, "api_keys", source)

    def resolved_named_keys(self, source: str = "config") -> list[tuple[NamedKey, bytes]]:
        """Every named key (YAML, env, file) with the SHA-256 of its key; ConfigError naming the bad entry."""
        entries = [(f"gateway.keys[{index}]", entry) for index, entry in enumerate(self.keys)]
        if self.keys_env:
            text = os.environ.get(self.keys_env)
            if text is None:
                raise ConfigError(f"{source}: gateway.keys_env: environment variable {self.keys_env} is not set")
            entries += _named_keys_from(text, f"gateway.keys_env ({self.keys_env})", source)
        if self.keys_file:
            try:
                text = self.keys_file.read_text()
            except OSError as error:
                raise ConfigError(f"{source}: gateway.keys_file: cannot read {self.keys_file}: {error.strerror}") from None
            from_file = _named_keys_from(text, f"{self.keys_file}", source)
            for where, entry in from_file:
                if entry.key is not None or entry.key_env is not None:
                    raise ConfigError(f"{source}: {where}: a keys file holds hashes, not keys: give key_sha256 (sglang-gateway hash-key prints it)")
            entries += from_file
        resolved: list[tuple[NamedKey, bytes]] = []
        names: set[str] = set()
        digests: set[bytes] = set()
        for where, entry in entries:
            digest = entry.digest(source, where)
            if entry.name in names:
                raise ConfigError(f"{source}: {where}.name: {entry.name!r} names another key too (one entry per tenant)")
            if digest in digests:
                raise ConfigError(f"{source}: {where}: the same key is given to another named key")
            names.add(entry.name)
            digests.add(digest)
            resolved.append((entry, digest))
        return resolved

    def resolved_admin_keys(self, source: str = "config") -> tuple[bytes, ...]:
        """The /admin keys, resolved like the client keys; empty means the admin API is off."""
        return _resolve_keys(self.admin_keys, self.admin_keys_env, self.admin_keys_file, "admin_keys", source)

    def resolved_metrics_keys(self, source: str = "config") -> tuple[bytes, ...]:
        """The metrics key (YAML, env or file, resolved like the admin keys): reads all of /metrics, nothing else."""
        listed = [self.metrics_key] if self.metrics_key is not None else []
        return _resolve_keys(listed, self.metrics_key_env, self.metrics_key_file, "metrics_key", source)


def auto_workers(cpus: int) -> int:
    """``workers: auto``: one process below 4 CPUs (the engines' own processes need the rest), else one per 4 CPUs,
    at most 8. One worker relays about 30k SSE events/s (benchmarks/README.md); an 8-GPU host emits 100k+."""
    return 1 if cpus < 4 else min(8, cpus // 4)


def _resolve_keys(
    listed: list[SecretStr], env: str | None, file: Path | None, field: str, source: str
) -> tuple[bytes, ...]:
    keys = [key.get_secret_value().strip() for key in listed]
    if env:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"{source}: gateway.{field}_env: environment variable {env} is not set")
        keys += [part.strip() for part in value.split(",") if part.strip()]
    if file:
        try:
            text = file.read_text()
        except OSError as error:
            raise ConfigError(f"{source}: gateway.{field}_file: cannot read {file}: {error.strerror}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ConfigError(f"{source}: gateway.{field}_file: {file} holds no key")
    return tuple(dict.fromkeys(key.encode() for key in keys))


def _named_keys_from(text: str, where: str, source: str) -> list[tuple[str, NamedKey]]:
    """The named keys of a keys file or variable: a YAML (or JSON) list of entries like ``gateway.keys``."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: {where}: not YAML or JSON: {str(error).splitlines()[0]}") from None
    if data is None:
        return []
    if not isinstance(data, list):
        raise ConfigError(f"{source}: {where}: must be a list of named keys (got {type(data).__name__})")
    entries = []
    for index, item in enumerate(data):
        try:
            entries.append((f"{where}[{index}]", NamedKey.model_validate(item)))
        except ValidationError as error:
            raise ConfigError(format_validation_error(f"{source}: {where}[{index}]", error)) from None
    return entries


def default_state_dir(source: Path | str) -> Path:
    """The state directory of the deployment read from ``source`` (a file, or a model URI), when none is configured.

    Under the user's XDG state directory (state that should survive restarts, unlike a cache), one per
    deployment: named by the config file's name and a hash of its absolute path, so two deployments never
    share an index and the same file finds its index again after a restart. A deployment built in memory
    (no file: tests, embedders of ``create_app``) has none unless ``state_dir`` is set: its index is memory only.
    """
    path = Path(source)
    where = str(path.resolve()) if path.exists() else str(source)
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:40] or "deployment"
    return base / "sglang-gateway" / f"{name}-{hashlib.blake2b(where.encode(), digest_size=6).hexdigest()}"


def gateway_settings(deployment: DeploymentConfig, **overrides: object) -> GatewaySettings:
    """Validate ``deployment.gateway`` (plus CLI overrides such as host/port that are not None)."""
    source = str(deployment.source or "config")
    data = dict(deployment.gateway)
    data.update({key: value for key, value in overrides.items() if value is not None})
    for key in (*GATEWAY_KEY_FILE_SETTINGS, "state_dir"):
        if isinstance(data.get(key), str) and deployment.source and not Path(data[key]).is_absolute():
            data[key] = str(Path(deployment.source).parent / data[key])
    if data.get("state_dir") is None and deployment.source is not None:
        data["state_dir"] = str(default_state_dir(deployment.source))
    try:
        settings = GatewaySettings.model_validate(data)
    except ValidationError as error:
        lines = format_validation_error(source, error).splitlines()
        raise ConfigError("\n".join(line.replace(f"{source}: ", f"{source}: gateway.", 1) for line in lines)) from None
    followers = [name for name, engine in deployment.managed().items() if engine.node_rank > 0]
    if followers:
        raise ConfigError(
            f"{source}: models.{followers[0]}.engine.node_rank: a machine with node_rank > 0 serves no HTTP; "
            "start it with `sglang-gateway launch` and serve the engine from the machine with node_rank 0"
        )
    settings = _check_residency(settings, deployment, source)
    settings = _check_replicas(settings, deployment, source)
    for key in GATEWAY_PER_MODEL_SETTINGS:
        unknown = sorted(set(getattr(settings, key)) - set(deployment.models))
        if unknown:
            raise ConfigError(f"{source}: gateway.{key}.{unknown[0]}: no model with this name")
    for model, names in settings.extension_fields.items():
        for name in names:
            if name not in EXTENSIONS:
                raise ConfigError(f"{source}: gateway.extension_fields.{model}: {name!r} is not an SGLang extension field the gateway knows")
    plain = settings.resolved_keys(source)
    admin = settings.resolved_admin_keys(source)
    if set(admin) & set(plain):
        raise ConfigError(f"{source}: gateway.admin_keys: an admin key must not also be a client key")
    _check_named_keys(settings, deployment, source, plain, admin)
    return settings


def _check_residency(settings: GatewaySettings, deployment: DeploymentConfig, source: str) -> GatewaySettings:
    """Residency groups named by models exist; residency runs in one process (``workers: auto`` becomes 1)."""
    resident = {name: entry.residency for name, entry in deployment.models.items() if entry.residency is not None}
    for name, residency in resident.items():
        if residency.group is not None and residency.group not in settings.residency_groups:
            known = ", ".join(settings.residency_groups) or "none is defined"
            raise ConfigError(f"{source}: models.{name}.residency.group: {residency.group!r} is not in gateway.residency_groups ({known})")
    if not resident:
        return settings
    if settings.workers != "auto" and int(settings.workers) > 1:
        first = next(iter(resident))
        raise ConfigError(f"{source}: models.{first}.residency: needs gateway.workers: 1 (models that start and stop on demand are served by one process)")
    return settings.model_copy(update={"workers": 1})


def _check_replicas(settings: GatewaySettings, deployment: DeploymentConfig, source: str) -> GatewaySettings:
    """Replicas share their state through PostgreSQL and launch no engines (each would start its own copy); each is
    one process (``workers: auto`` becomes 1): scale out with more replicas."""
    if not settings.replicas.shared:
        return settings
    url = settings.usage.database_url
    if url is None or not url.get_secret_value().startswith("postgresql+psycopg://"):
        raise ConfigError(
            f"{source}: gateway.replicas.shared needs gateway.usage.database_url: a PostgreSQL URL that every replica reaches "
            "(the shared store); got " + ("none" if url is None else "a SQLite file, which no other host reads")
        )
    launched = sorted(deployment.managed())
    if launched:
        raise ConfigError(
            f"{source}: models.{launched[0]}: replicas sharing one state serve url: or router upstreams; a model they launch "
            "would be started once per replica (serve it from its own gateway or engine, and point the replicas at its URL)"
        )
    if settings.workers != "auto" and int(settings.workers) > 1:
        raise ConfigError(
            f"{source}: gateway.workers: a replica sharing a store is one process (gateway.workers: 1); run more replicas instead"
        )
    return settings.model_copy(update={"workers": 1})


def _check_named_keys(settings: GatewaySettings, deployment: DeploymentConfig, source: str, plain: tuple[bytes, ...], admin: tuple[bytes, ...]) -> None:
    """Named keys name models of the file and priority classes that exist, and are neither plain client keys nor admin keys."""
    named = settings.resolved_named_keys(source)
    known = {label for name, entry in deployment.models.items() for label in (name, *entry.aliases)}
    others = {hashlib.sha256(key).digest(): kind for kinds, kind in ((plain, "gateway.api_keys"), (admin, "gateway.admin_keys")) for key in kinds}
    for entry, digest in named:
        unknown = sorted(set(entry.models or ()) - known)
        if unknown:
            raise ConfigError(f"{source}: gateway.keys ({entry.name}).models: {unknown[0]!r} is no model or alias of this file")
        for setting, value in entry.priority_classes():
            if class_number(value, settings.priority_classes) is None:
                named = ", ".join(settings.priority_classes) or "none is named"
                raise ConfigError(
                    f"{source}: gateway.keys ({entry.name}).{setting}: {value!r} is no class of gateway.priority_classes ({named})"
                )
        if digest in others:
            raise ConfigError(f"{source}: gateway.keys ({entry.name}): its key is also in {others[digest]}")


def reference_table() -> str:
    """The ``gateway:`` settings reference of docs/configuration.md, drawn from the settings' own descriptions
    (a test checks that page holds exactly this)."""
    return settings_table(GatewaySettings)
