"""The Kubernetes recipe (``deploy/kubernetes/``) is checked by the tools that will read it.

Every manifest parses; the router container's arguments go through sglang-router's own argument parser (and its
validation); the gateway's YAML (its ConfigMap) through ``sglang-gateway check``; the workers' engine section
through this project's config and SGLang's own server-argument parser. And the pieces agree with each other: the
router finds the worker pods by their labels and port, the gateway's model URL is the router's Service, the keys
come from the Secret, the router may read pods (RBAC), the network policies select the right pods.
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

import pytest
import yaml

from launch.argv import server_args
from launch.config import parse_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "deploy" / "kubernetes"
PARSE_SGLANG_ARGV = REPO / "tests" / "launch" / "sglang_parse_argv.py"
NAMESPACE = "llm"


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
    assert set(secrets) == {gateway["api_keys_env"], gateway["admin_keys_env"]}  # every key from the Secret
    assert {ref["name"] for ref in secrets.values()} == {"sglang-gateway-keys"}
    env = {**os.environ, **{name: f"test-{ref['key']}" for name, ref in secrets.items()}}
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
    ):
        spec = DOCS[("NetworkPolicy", policy)]["spec"]
        assert spec["podSelector"]["matchLabels"].items() <= _pod_labels(*target).items(), policy
        (admitted,) = [rule["from"][0]["podSelector"]["matchLabels"] for rule in spec["ingress"] if "from" in rule]
        assert admitted.items() <= _pod_labels(*source).items(), policy
