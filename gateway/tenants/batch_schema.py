"""The batch API's tables, kept in the usage ledger's database (migrated with it: :mod:`gateway.tenants.ledger_schema`).

Files' bytes live in the state directory (:mod:`gateway.batches.files`), or, for replicas sharing one database, in
``batch_file_chunks`` (migration 3); these tables hold what must survive a SIGKILL with them: which files and batches
exist and whose they are, and each line's state and answer, written as each line ends, so a restarted gateway resumes
a batch at the lines still queued. A batch's lease (``leased_by``, ``lease_until``; migration 3) says which gateway
runs it now: one at a time, another taking over once the lease runs out unrenewed.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Index, Integer, LargeBinary, MetaData, String, Table, Text

metadata = MetaData()

batch_files = Table(
    "batch_files",
    metadata,
    Column("id", String(64), primary_key=True),  # file-<hex>
    Column("owner", String(200), nullable=False),  # the creating key's identity (gateway.edge.auth.request_owner)
    Column("purpose", String(32), nullable=False),  # batch (uploaded), batch_output (written by a batch)
    Column("filename", String(256), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),  # unix seconds
    Index("batch_files_owner", "owner", "created_at"),
)

batches = Table(
    "batches",
    metadata,
    Column("id", String(64), primary_key=True),  # batch_<hex>
    Column("owner", String(200), nullable=False),
    Column("key_name", String(200)),  # the named key that created it (ledger rows carry it), None: unnamed/open
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("in_progress_at", BigInteger),
    Column("finalizing_at", BigInteger),
    Column("completed_at", BigInteger),
    Column("failed_at", BigInteger),
    Column("expired_at", BigInteger),
    Column("cancelling_at", BigInteger),
    Column("cancelled_at", BigInteger),
    Column("output_file_id", String(64)),
    Column("error_file_id", String(64)),
    Column("metadata", Text),  # JSON object (at most 16 string pairs)
    Column("errors", Text),  # JSON: OpenAI's {"object": "list", "data": [{code, message, line}]} of a failed batch
    Column("total", Integer, nullable=False),
    Column("completed", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
    Column("leased_by", String(200)),  # the gateway running it now (replicas.name; "local" for a lone gateway); migration 3
    Column("lease_until", Float),  # the database clock's unix seconds the lease runs out at, unless renewed; migration 3
    Index("batches_owner", "owner", "created_at"),
    Index("batches_status", "status"),
)

batch_lines = Table(
    "batch_lines",
    metadata,
    Column("batch_id", String(64), primary_key=True),
    Column("line", Integer, primary_key=True),  # 0-based line of the input file (blank lines skipped, not counted)
    Column("custom_id", String(512), nullable=False),
    Column("state", String(16), nullable=False),  # queued, done (any HTTP answer), failed (no answer: the gateway's own error)
    Column("status_code", Integer),
    Column("request_id", String(128)),
    Column("result", Text),  # the answer's JSON body (done), or the error object (failed)
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Index("batch_lines_state", "batch_id", "state"),
)

batch_file_chunks = Table(
    "batch_file_chunks",
    metadata,
    Column("file_id", String(64), primary_key=True),
    Column("seq", Integer, primary_key=True),  # 0, 1, ...: the file is its chunks in this order
    Column("data", LargeBinary, nullable=False),  # bytea / BLOB, at most gateway.batches.files.CHUNK bytes
)

TABLES = (batch_files, batches, batch_lines)  # migration 2
LEASE_COLUMNS = {"leased_by": "VARCHAR(200)", "lease_until": "DOUBLE PRECISION"}  # migration 3, on a table of migration 2

