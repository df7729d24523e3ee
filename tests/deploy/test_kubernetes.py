"""The Kubernetes recipe (``deploy/kubernetes/``) is checked by the tools that will read it.

Every manifest parses; the router container's arguments go through sglang-router's own argument parser (and its
validation); the gateway's YAML (its ConfigMap) through ``sglang-gateway check``; the workers' engine section
through this project's config and SGLang's own server-argument parser. And the pieces agree with each other: the
router finds the worker pods by their labels and port, the gateway's model URL is the router's Service, the keys
come from the Secret, the router may read pods (RBAC), the network policies select the right pods. The gateway's
replicas share a store (the PostgreSQL of ``postgres.yaml``, at the URL its Secret is documented with) and are
replaced one at a time without failing a request: a rolling update that keeps every pod until its successor is
ready, a readiness probe on ``/ready``, a drain (``shutdown_delay_s``) longer than that probe takes to notice it, a
termination grace period that holds the drain and the in-flight requests, and a disruption budget.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from launch.argv import server_args
from launch.config import parse_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "deploy" / "kubernetes"
PARSE_SGLANG_ARGV = REPO / "tests" / "launch" / "sglang_parse_argv.py"
NAMESPACE = "llm"
STORE_SECRET = "sglang-gateway-store"


def _documents() -> dict[tuple[str, str], dict[str, Any]]:
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(RECIPE.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), (path.name, doc)
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in docs, f"{key} defined twice"
            docs[key] = doc
    return docs


DOCS = _documents()


def _container(kind: str, name: str) -> dict[str, Any]:
    (container,) = DOCS[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return container


def _pod_labels(kind: str, name: str) -> dict[str, str]:
    return DOCS[(kind, name)]["spec"]["template"]["metadata"]["labels"]


def _expand(args: list[str], container: dict[str, Any]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion in args, with the pod's namespace for a fieldRef to it."""
    values = {}
    for env in container.get("env", []):
        field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        values[env["name"]] = NAMESPACE if field == "metadata.namespace" else env.get("value", "")
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in args]


def _router_args() -> Any:
    from sglang_router.launch_router import parse_router_args

    container = _container("Deployment", "sglang-router")
    assert container["command"] == ["python", "-m", "sglang_router.launch_router"]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_router_args(_expand(container["args"], container))
    except SystemExit:
        pytest.fail(f"sglang-router refused the router's arguments: {stderr.getvalue().strip().splitlines()[-1:]}")
    args._validate_router_args()
    return args


def _config_map_file(name: str, key: str, tmp_path: Path) -> Path:
    path = tmp_path / key
    path.write_text(DOCS[("ConfigMap", name)]["data"][key])
    return path


def test_every_manifest_parses_and_kustomize_lists_them_all() -> None:
    kustomization = yaml.safe_load((RECIPE / "kustomization.yaml").read_text())
    files = {path.name for path in RECIPE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files and kustomization["namespace"] == NAMESPACE
    assert {kind for kind, _ in DOCS} >= {
        "StatefulSet",
        "Deployment",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
    }


def test_the_router_arguments_pass_its_own_parser_and_find_the_workers() -> None:
    args = _router_args()
    assert args.service_discovery and args.service_discovery_namespace == NAMESPACE
    worker_labels = _pod_labels("StatefulSet", "sglang-worker")
    assert args.selector and all(worker_labels.get(key) == value for key, value in args.selector.items()), args.selector
    (port,) = _container("StatefulSet", "sglang-worker")["ports"]
    assert args.service_discovery_port == port["containerPort"]
    assert args.worker_urls == [] and args.policy == "cache_aware"
    router_ports = {p["name"]: p["containerPort"] for p in _container("Deployment", "sglang-router")["ports"]}
    assert (args.port, args.prometheus_port) == (router_ports["http"], router_ports["metrics"])


def test_a_misspelled_router_flag_would_be_caught() -> None:
    from sglang_router.launch_router import parse_router_args

    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        parse_router_args(["--service-discovery", "--selektor", "app=x"])


def test_the_router_may_watch_pods_and_nothing_more() -> None:
    (rule,) = DOCS[("Role", "sglang-router-pod-reader")]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    binding = DOCS[("RoleBinding", "sglang-router-pod-reader")]
    assert binding["roleRef"]["name"] == "sglang-router-pod-reader"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sglang-router"}]
    assert DOCS[("Deployment", "sglang-router")]["spec"]["template"]["spec"]["serviceAccountName"] == "sglang-router"
    assert ("ServiceAccount", "sglang-router") in DOCS


def test_the_gateway_yaml_passes_check_and_points_at_the_router_service(tmp_path: Path) -> None:
    config = _config_map_file("sglang-gateway-config", "gateway.yaml", tmp_path)
    container = _container("Deployment", "sglang-gateway")
    assert container["command"] == ["sglang-gateway", "serve", "/etc/sglang-gateway/gateway.yaml"]
    secrets = {
        env["name"]: env["valueFrom"]["secretKeyRef"]
        for env in container["env"]
        if "secretKeyRef" in env.get("valueFrom", {})
    }
    gateway = yaml.safe_load(config.read_text())["gateway"]
    database_env = re.fullmatch(r"\$\{(\w+)\}", gateway["usage"]["database_url"])
    assert database_env and gateway["replicas"]["shared"]  # the shared store's URL from the environment
    keys = {gateway["api_keys_env"], gateway["admin_keys_env"]}
    assert set(secrets) == keys | {database_env.group(1)}  # every key and the store's URL from a Secret
    assert {secrets[name]["name"] for name in keys} == {"sglang-gateway-keys"}
    assert secrets[database_env.group(1)] == {"name": STORE_SECRET, "key": "database-url"}
    env = {**os.environ, **{name: f"test-{ref['key']}" for name, ref in secrets.items()}}
    env[database_env.group(1)] = _documented_store_url().replace("<pw>", "test-password")
    check = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check", str(config)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr
    (url,) = re.findall(r"external engine at (\S+)", check.stdout)
    service = DOCS[("Service", "sglang-router")]
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert url == f"http://{service['metadata']['name']}:{http['port']}"
    probes = {container[probe]["httpGet"]["path"] for probe in ("readinessProbe", "livenessProbe")}
    assert probes == {"/ready", "/health"} and set(gateway["open_paths"]) >= probes


def _documented_store_url() -> str:
    """The database-url the recipe says to put in the store's Secret (kustomization.yaml's comment)."""
    (url,) = re.findall(r"database-url=(\S+)", (RECIPE / "kustomization.yaml").read_text())
    return url


def _gateway_settings() -> dict[str, Any]:
    return yaml.safe_load(DOCS[("ConfigMap", "sglang-gateway-config")]["data"]["gateway.yaml"])["gateway"]


def test_the_gateway_replicas_are_replaced_one_at_a_time_and_drain_first() -> None:
    deployment = DOCS[("Deployment", "sglang-gateway")]["spec"]
    gateway, container = _gateway_settings(), _container("Deployment", "sglang-gateway")
    assert deployment["replicas"] == gateway["replicas"]["expected"] >= 2
    assert deployment["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    probe = container["readinessProbe"]
    assert probe["httpGet"] == {"path": "/ready", "port": "http"}  # 503 while draining: the pod leaves the endpoints
    # the drain outlasts the probe's verdict (period x failures), and the grace period holds drain and requests
    noticed_s = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    assert gateway["shutdown_delay_s"] > noticed_s, (gateway["shutdown_delay_s"], noticed_s)
    pod = deployment["template"]["spec"]
    pre_stop_s = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + gateway["shutdown_delay_s"] + gateway["shutdown_grace_s"]
    budget = DOCS[("PodDisruptionBudget", "sglang-gateway")]["spec"]
    assert budget["minAvailable"] == 1 < deployment["replicas"]
    assert budget["selector"]["matchLabels"].items() <= _pod_labels("Deployment", "sglang-gateway").items()


def test_the_shared_store_is_the_postgres_the_secret_names() -> None:
    url = urlsplit(_documented_store_url())
    service = DOCS[("Service", "sglang-gateway-postgres")]
    statefulset = DOCS[("StatefulSet", "sglang-gateway-postgres")]["spec"]
    (port,) = service["spec"]["ports"]
    assert (url.scheme, url.hostname, url.port) == ("postgresql", service["metadata"]["name"], port["port"])
    assert service["spec"]["selector"].items() <= _pod_labels("StatefulSet", "sglang-gateway-postgres").items()
    assert statefulset["serviceName"] == service["metadata"]["name"]
    container = _container("StatefulSet", "sglang-gateway-postgres")
    env = {item["name"]: item for item in container["env"]}
    assert (url.username, url.path.lstrip("/")) == (env["POSTGRES_USER"]["value"], env["POSTGRES_DB"]["value"])
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": STORE_SECRET, "key": "password"}
    (container_port,) = container["ports"]
    assert port["targetPort"] == container_port["name"] and container_port["containerPort"] == 5432
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    (claim,) = statefulset["volumeClaimTemplates"]
    assert env["PGDATA"]["value"].startswith(mounts[claim["metadata"]["name"]] + "/")  # on the volume, below its root


def test_the_workers_engine_section_passes_sglangs_parser(tmp_path: Path) -> None:
    pytest.importorskip("sglang")
    config = parse_config(
        yaml.safe_load(DOCS[("ConfigMap", "sglang-worker-config")]["data"]["worker.yaml"]), "worker.yaml"
    )
    ((name, engine),) = config.managed().items()
    container = _container("StatefulSet", "sglang-worker")
    assert container["command"] == ["sglang-gateway", "launch", "/etc/sglang-gateway/worker.yaml"]
    (port,) = container["ports"]
    assert engine.host == "0.0.0.0" and engine.port == port["containerPort"]
    assert engine.tp_size * engine.dp_size == int(container["resources"]["limits"]["nvidia.com/gpu"])
    argv = server_args(engine, port=engine.port, served_model_name=name)
    proc = subprocess.run(
        [sys.executable, str(PARSE_SGLANG_ARGV)], input=json.dumps({"fields": ["host", "port", "tp_size"], "argvs": [argv]}),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line, proc.stderr[-2000:]
    (parsed,) = json.loads(line.removeprefix("RESULTS "))
    assert parsed["ok"], parsed
    assert parsed["args"] == {"host": "0.0.0.0", "port": engine.port, "tp_size": engine.tp_size}


def test_workers_have_gpus_health_probes_and_a_memory_backed_dev_shm() -> None:
    spec = DOCS[("StatefulSet", "sglang-worker")]["spec"]["template"]["spec"]
    container = _container("StatefulSet", "sglang-worker")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    (dshm,) = [volume for volume in spec["volumes"] if volume["name"] == "dshm"]
    assert mounts["dshm"] == "/dev/shm" and dshm["emptyDir"]["medium"] == "Memory"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]


def test_network_policies_admit_the_router_to_workers_and_the_gateway_to_the_router() -> None:
    for policy, target, source in (
        ("sglang-worker-from-router", ("StatefulSet", "sglang-worker"), ("Deployment", "sglang-router")),
        ("sglang-router-from-gateway", ("Deployment", "sglang-router"), ("Deployment", "sglang-gateway")),
        ("sglang-gateway-postgres-from-gateway", ("StatefulSet", "sglang-gateway-postgres"), ("Deployment", "sglang-gateway")),
    ):
        spec = DOCS[("NetworkPolicy", policy)]["spec"]
        assert spec["podSelector"]["matchLabels"].items() <= _pod_labels(*target).items(), policy
        (admitted,) = [rule["from"][0]["podSelector"]["matchLabels"] for rule in spec["ingress"] if "from" in rule]
        assert admitted.items() <= _pod_labels(*source).items(), policy
