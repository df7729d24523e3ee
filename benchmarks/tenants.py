"""The cost of tenants: ``compare --tenants`` runs a second gateway with a named key and the usage ledger, next to
the plain one, in the same run (batches alternate over direct, gateway and gateway-keys).

- ``gateway``: the plain gateway, no key, no ledger: what the gateway costs without tenants;
- ``gateway-keys``: the same upstream behind a gateway that requires one named key with every limit set so high
  that none bites (requests and tokens per minute, requests in flight, day and month budgets: every quota path
  runs, none refuses), and writes the usage ledger to SQLite in the results directory; the load generator sends
  that key;
- ``gateway-twin``: a second plain gateway, identical to the first (an A/A control): how far two identical
  gateways land apart in the same run is the run's noise, which the keyed gateway's drop is judged against.

With ``compare --shared`` too:

- ``gateway-shared``: the keyed gateway as a replica sharing a store (``gateway.replicas.shared``): the same key and
  limits, its ledger and the shared state (per-key usage exchanged every ``sync_interval_s``, stored responses
  published on create) in a PostgreSQL server of the run's own (:mod:`benchmarks.postgres`), one process; every
  gateway of such a run is one process (``workers: 1``), as a shared replica is.

The report gives gateway-keys against the plain gateway (its targets: :func:`benchmarks.stats.evaluate_tenant_targets`),
gateway-shared against gateway-keys (:func:`benchmarks.stats.evaluate_shared_targets`), and counts the ledgers' rows
after the run (one per request sent, warm-ups included, when nothing was lost).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, func, select

from gateway.core.shared_store import responses
from gateway.tenants.ledger_schema import usage_rows

KEYED = "gateway-keys"  # the target's name in the results
TWIN = "gateway-twin"  # the plain gateway's identical twin (the run's noise)
SHARED = "gateway-shared"  # the keyed gateway as a replica sharing a PostgreSQL store
KEY = "sk-bench-tenant-0123456789abcdef"  # loopback only, for the run's own gateway
NEVER = 10**15  # a limit no benchmark reaches
LEDGER_FILE = "usage-ledger.sqlite3"


def plain_settings(out_dir: Path) -> dict[str, Any]:
    """The plain gateway of a tenants run: the ledger off (the default writes one), state in the results directory."""
    return {"usage.enabled": False, "state_dir": str(out_dir / "gateway-state")}


def twin_settings(out_dir: Path) -> dict[str, Any]:
    """The plain gateway's twin: the same settings, its own state directory."""
    return {**plain_settings(out_dir), "state_dir": str(out_dir / "gateway-twin-state")}


def keyed_settings(out_dir: Path) -> dict[str, Any]:
    """The gateway with one named key whose limits never bite, and the usage ledger in ``out_dir``."""
    limits = {name: NEVER for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent", "tokens_per_day", "tokens_per_month")}
    return {
        "keys": [{"name": "bench", "key": KEY, "limits": limits}],
        "usage.enabled": True,
        "usage.database_url": f"sqlite:///{out_dir / LEDGER_FILE}",
        "state_dir": str(out_dir / "gateway-keys-state"),
    }


def one_process(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``workers: 1``: every gateway of a ``--shared`` run is one process, as a shared replica is."""
    return {**settings, "workers": 1}


def shared_settings(out_dir: Path, database_url: str) -> dict[str, Any]:
    """The keyed gateway as the one replica sharing the store at ``database_url`` (its ledger there too)."""
    return {
        **keyed_settings(out_dir),
        "workers": 1,
        "usage.database_url": database_url,
        "replicas": {"shared": True, "name": "bench", "expected": 1},  # sync_interval_s: the default
        "state_dir": str(out_dir / "gateway-shared-state"),
    }


def headers() -> dict[str, str]:
    """What the load generator sends to the keyed gateway."""
    return {"authorization": f"Bearer {KEY}"}


def ledger_rows(out_dir: Path) -> dict[str, int] | None:
    """Rows the keyed gateway wrote (read once it stopped: it writes its buffer on SIGTERM), by key name and status."""
    path = out_dir / LEDGER_FILE
    if not path.exists():
        return None
    with sqlite3.connect(path) as db:
        found = db.execute(f"SELECT key_name, status, COUNT(*) FROM {usage_rows.name} GROUP BY key_name, status").fetchall()
    return {f"{key}:{status}": count for key, status, count in found}


def store_rows(database_url: str) -> dict[str, Any]:
    """What the shared replica left in the store (read once it stopped, before the store does): its ledger rows by
    key name and status, and the stored responses it published."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            found = conn.execute(select(usage_rows.c.key_name, usage_rows.c.status, func.count()).group_by(usage_rows.c.key_name, usage_rows.c.status)).all()
            published = conn.execute(select(func.count()).select_from(responses)).scalar_one()
    finally:
        engine.dispose()
    return {"ledger_rows": {f"{key}:{status}": count for key, status, count in found}, "responses_published": published}
