"""A gateway over ``replicas: N`` of the tiny CPU engine, driven through its admin API: the rig of the benchmarks
that compare ways of reaching the same running engines (balancing policies, SGLang's router in front of them,
the engines themselves).

The gateway runs as its own process (``sglang-gateway serve``) from a YAML this module writes; settings change by
rewriting that YAML and ``POST /admin/reload`` (a balancing policy or a ``router:`` section: the engines keep
running). The engines' addresses and pids come from ``GET /admin/models``, their counters from their ``/metrics``.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from benchmarks import processes
from launch.ports import pick_free_port

MODEL = "tiny"
ADMIN_KEY_ENV = "BENCH_ADMIN_KEY"
DEFAULT_POLICY = "least_in_flight"


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample named ``name`` in Prometheus text whose labels include ``labels``."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items())
    )


def deployment_for(
    model_dir: Path,
    replicas: int,
    max_total_tokens: int,
    max_imbalance: int,
    port: int,
    engine_python: Path | None = None,
) -> dict[str, Any]:
    """The gateway YAML: ``replicas`` of the tiny CPU engine reporting cached tokens, no client keys, the admin
    API on (its key in ``$BENCH_ADMIN_KEY`` of the gateway's process, never in the file); ``engine_python``: the
    engines' interpreter (see :func:`key_tap_python`)."""
    engine = {
        "model_path": str(model_dir), "device": "cpu", "dtype": "float32", "max_total_tokens": max_total_tokens,
        "skip_server_warmup": True, "startup_timeout_s": 600, "extra_args": ["--enable-cache-report"],
    }  # fmt: skip
    if engine_python is not None:
        engine["python"] = str(engine_python)
    return {
        "models": {MODEL: {"replicas": replicas, "engine": engine}},
        "gateway": {
            "host": "127.0.0.1", "port": port, "log_requests": False, "admin_keys_env": ADMIN_KEY_ENV,
            "balancing": {"policy": DEFAULT_POLICY, "max_imbalance": max_imbalance},
        },
    }  # fmt: skip


_KEY_TAP = """#!/bin/sh
# Written by the benchmarks: the interpreter of the gateway's engines. Before it runs SGLang it keeps a copy of
# the private --config file the launcher hands the engine (it holds the engines' API key, which the gateway
# never shows), so that the benchmark's client can also reach the engines directly, with the key they require.
prev=
for arg in "$@"; do
  if [ "$prev" = "--config" ]; then (umask 077; cp "$arg" "{keys}/$(basename "$arg")"); fi
  prev=$arg
done
exec "{python}" "$@"
"""


def key_tap_python(directory: Path) -> tuple[Path, Path]:
    """An ``engine.python`` wrapper that copies each engine's ``--config`` file into ``directory/engine-keys``
    (owner-only) and runs this interpreter; returns (the wrapper, the keys directory)."""
    keys = directory / "engine-keys"
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    wrapper = directory / "engine-python"
    wrapper.write_text(_KEY_TAP.format(keys=keys, python=sys.executable))
    wrapper.chmod(stat.S_IRWXU)
    return wrapper, keys


def tapped_engine_key(keys: Path) -> str:
    """The one API key of the model's engines, from the copies :func:`key_tap_python` kept (RuntimeError when
    there is none, or several: the gateway gives all replicas of a model one key)."""
    found = {str((yaml.safe_load(path.read_text()) or {}).get("api-key")) for path in keys.glob("*.yaml")}
    found.discard("None")
    if len(found) != 1:
        raise RuntimeError(f"expected one engine API key in {keys}, found {len(found)}")
    return found.pop()


@dataclass(frozen=True)
class Engine:
    url: str
    pid: int


class ReplicaRig:
    """The running gateway over the replicas, seen through its admin API and metrics and the engines' metrics."""

    def __init__(
        self, gateway_url: str, admin_key: str, config: Path, deployment: dict[str, Any], gateway_pid: int
    ) -> None:
        self.url, self.admin_key, self.config, self.deployment = gateway_url, admin_key, config, deployment
        self.gateway_pid = gateway_pid  # its process group: the gateway and nothing else (engines have their own)
        self.http = httpx.Client(timeout=900, trust_env=False)

    def close(self) -> None:
        self.http.close()

    @property
    def _admin(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"}

    def reload(self, what: str) -> None:
        """Write ``self.deployment`` to the YAML and reload it (RuntimeError naming ``what`` when refused)."""
        self.config.write_text(yaml.safe_dump(self.deployment, sort_keys=False))
        answer = self.http.post(self.url + "/admin/reload", headers=self._admin)
        report = answer.json() if answer.headers.get("content-type", "").startswith("application/json") else {}
        if answer.status_code != 200 or not report.get("ok"):
            raise RuntimeError(f"reload to {what} failed: HTTP {answer.status_code} {answer.text[:500]}")

    def set_policy(self, policy: str) -> None:
        """The gateway's balancing policy (a settings change: the engines keep running)."""
        self.deployment["gateway"]["balancing"]["policy"] = policy
        self.reload(policy)

    def set_router(self, policy: str | None) -> None:
        """SGLang's router in front of the replicas with ``policy``, or none (the engines keep running)."""
        model = self.deployment["models"][MODEL]
        if (model.get("router") or {}).get("policy") == policy:
            return
        if policy is None:
            model.pop("router", None)
        else:
            model["router"] = {"policy": policy}
        self.reload(f"router {policy}" if policy else "no router")

    def model_status(self) -> dict[str, Any]:
        answer = self.http.get(self.url + "/admin/models", headers=self._admin)
        (model,) = [m for m in answer.json()["models"] if m["name"] == MODEL]
        return model

    def engines(self) -> list[Engine]:
        return [
            Engine(f"http://127.0.0.1:{replica['engine']['port']}", int(replica["engine"]["pid"]))
            for replica in self.model_status()["replicas"]
        ]

    def engine_urls(self) -> list[str]:
        return [engine.url for engine in self.engines()]

    def router_pid(self) -> int | None:
        """The pid of SGLang's router in front of the replicas (None when there is none)."""
        router = self.model_status().get("router")
        return int(router["pid"]) if router and router.get("pid") else None

    def engine_metric(self, name: str) -> dict[str, float]:
        """``name`` summed over its samples, per engine URL (from the engines' own ``/metrics``)."""
        return {url: metric_sum(self.http.get(url + "/metrics").text, name) for url in self.engine_urls()}


@contextmanager
def replica_gateway(deployment: dict[str, Any], out_dir: Path, console: Console) -> Iterator[ReplicaRig]:
    """``sglang-gateway serve`` with ``deployment`` (written to ``out_dir/gateway.yaml``; its port is the
    YAML's), ready once every replica is; a :class:`ReplicaRig` on it until the block ends."""
    config = out_dir / "gateway.yaml"
    config.write_text(yaml.safe_dump(deployment, sort_keys=False))
    admin_key = secrets.token_urlsafe(24)
    port = deployment["gateway"]["port"]
    replicas = deployment["models"][MODEL]["replicas"]
    console.print(f"starting the gateway with {replicas} replicas of the tiny CPU engine (1-3 min)")
    started = time.monotonic()
    env = {ADMIN_KEY_ENV: admin_key}
    with processes.serving(config, port, out_dir, env, ready_timeout_s=900, stop_grace_s=60) as (url, child):
        console.print(f"gateway ready at {url} after {time.monotonic() - started:.0f}s")
        rig = ReplicaRig(url, admin_key, config, deployment, child.pid)
        try:
            yield rig
        finally:
            rig.close()


def tiny_deployment(
    out_dir: Path, replicas: int, max_total_tokens: int = 2048, max_imbalance: int = 4, tap_keys: bool = False
) -> tuple[dict[str, Any], Path | None]:
    """The rig's deployment on a free port; with ``tap_keys``, engines whose key the benchmark can read (the
    keys directory is returned, else None)."""
    wrapper, keys = key_tap_python(out_dir) if tap_keys else (None, None)
    model_dir = processes.tiny_model_dir()
    return deployment_for(model_dir, replicas, max_total_tokens, max_imbalance, pick_free_port(), wrapper), keys


def forget_keys(keys: Path | None) -> None:
    """Remove the copied engine keys (the engines are gone; no key stays on disk)."""
    if keys is None or not keys.is_dir():
        return
    for path in keys.iterdir():
        path.unlink(missing_ok=True)
    os.rmdir(keys)
