"""The processes a benchmark runs: the fake upstream, the gateway (``sglang-gateway serve``), the real
SGLang CPU engine, SGLang's router (``sglang_router.launch_router``), and the profiler. Each child runs in its own process group with a parent-death signal
and is stopped by signalling that group (never by name)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from launch.ports import pick_free_port
from launch.procgroup import child_pids, group_pids, popen_group, stat_fields, stop_group

REPO = Path(__file__).resolve().parent.parent


class Child:
    """A subprocess in its own process group, output to a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._sink = open(log, "wb")
        self.proc = popen_group(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=REPO,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0, sig: signal.Signals = signal.SIGTERM) -> int | None:
        """``sig`` to the whole group, SIGKILL after ``grace_s``; returns the exit code."""
        returncode = stop_group(self.proc, grace_s, first=sig, label=self.name)
        self._sink.close()
        return returncode

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_http(url: str, child: Child | None = None, timeout_s: float = 60.0) -> None:
    """Until ``url`` answers 200 (RuntimeError with the log tail when the child exits or time runs out)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if child is not None and not child.alive():
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}:\n{child.tail()}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{url} was not ready after {timeout_s:.0f}s" + (f":\n{child.tail()}" if child else ""))


@contextmanager
def fake_upstream(kind: str, logs: Path, step_ms: float = 20.0) -> Iterator[tuple[str, Child]]:
    """The fake upstream of ``kind`` (``starlette``, ``raw``, or ``paced``: a decode loop of ``step_ms``)."""
    port = pick_free_port()
    argv = [sys.executable, "-m", "benchmarks.fake_upstream", "--port", str(port), "--kind", kind]
    if kind == "paced":
        argv = [sys.executable, "-m", "benchmarks.paced_upstream", "--port", str(port), "--step-ms", str(step_ms)]
    with _healthy(Child(f"fake upstream ({kind})", argv, logs / "fake-upstream.log"), port) as running:
        yield running


@contextmanager
def floor_proxy(upstream_url: str, logs: Path) -> Iterator[tuple[str, Child]]:
    """The floor under a Python proxy (:mod:`benchmarks.floor_proxy`) in front of ``upstream_url``."""
    port = pick_free_port()
    argv = [sys.executable, "-m", "benchmarks.floor_proxy", "--port", str(port), "--upstream", upstream_url]
    logs.mkdir(parents=True, exist_ok=True)
    with _healthy(Child("the Python floor proxy", argv, logs / "floor-proxy.log"), port) as running:
        yield running


@contextmanager
def _healthy(child: Child, port: int) -> Iterator[tuple[str, Child]]:
    """``child``'s base URL once its ``/health`` answers (60 s at most), and ``child``; stopped when the block ends."""
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", child, 60)
        yield url, child
    finally:
        child.stop()


FLOOR_TARGET = "python-floor"  # costs --floor: the least a proxy on the gateway's stack costs (benchmarks.floor_proxy)


def gateway_config(upstream_url: str, port: int, path: Path, model: str = "bench", settings: dict[str, Any] | None = None) -> Path:
    """The gateway YAML for one external model at ``upstream_url``: no auth, no request log lines.

    ``settings``: more ``gateway:`` settings, by dotted name (``http.max_connections: 8192``)."""
    gateway: dict[str, Any] = {"host": "127.0.0.1", "port": port, "log_requests": False}
    for dotted, value in (settings or {}).items():
        *parents, leaf = dotted.split(".")
        node = gateway
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({"models": {model: {"url": upstream_url}}, "gateway": gateway}, sort_keys=False)
    path.write_text("# written by benchmarks: one model by URL, auth off (no keys), per-request log off\n" + text)
    return path


BASELINE = "gateway-baseline"  # --baseline: the same gateway from another checkout, in the same run
ROUTER_TARGET = "router"  # compare --router-target: SGLang's router as a target of its own, beside the gateway


def baseline_env(env: dict[str, str], checkout: Path) -> dict[str, str]:
    """``env`` for a gateway that runs the code of ``checkout`` (a worktree of another commit: before / after in
    one run); raises ValueError when it is not a checkout of this project."""
    if not (checkout / "gateway" / "__init__.py").is_file():
        raise ValueError(f"{checkout}: not a checkout of this project (no gateway/__init__.py)")
    return {**env, "PYTHONPATH": str(checkout.resolve())}


def gateway_argv(config: Path) -> list[str]:
    script = Path(sys.executable).with_name("sglang-gateway")
    if script.exists():
        return [str(script), "serve", str(config)]
    found = shutil.which("sglang-gateway")
    return [found, "serve", str(config)] if found else [sys.executable, "-m", "gateway.cli", "serve", str(config)]


@contextmanager
def gateway(
    upstream_url: str, logs: Path, env: dict[str, str] | None = None, settings: dict[str, Any] | None = None
) -> Iterator[tuple[str, Child]]:
    """``sglang-gateway serve`` in front of ``upstream_url`` (its own process), until the block ends."""
    port = pick_free_port()
    config = gateway_config(upstream_url, port, logs / "gateway.yaml", settings=settings)
    with serving(config, port, logs, env) as served:
        yield served


@contextmanager
def serving(
    config: Path, port: int, logs: Path, env: dict[str, str] | None = None, ready_timeout_s: float = 60, stop_grace_s: float = 15
) -> Iterator[tuple[str, Child]]:
    """``sglang-gateway serve CONFIG`` (its own process; ``port``: the YAML's), ready once ``/ready`` is 200.

    A gateway that launches engines stops them on SIGTERM: give it ``stop_grace_s`` for that."""
    child = Child("gateway", gateway_argv(config), logs / "gateway.log", env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready", child, ready_timeout_s)
        yield url, child
    finally:
        child.stop(grace_s=stop_grace_s)


def tiny_model_dir() -> Path:
    """The tiny offline model (``$SGLANG_GATEWAY_TINY_MODEL``, else ``.cache/tiny-model``), built if missing."""
    tiny = Path(os.environ.setdefault("SGLANG_GATEWAY_TINY_MODEL", str(REPO / ".cache" / "tiny-model")))
    if not tiny.is_dir():
        from launch.tiny_model import build_tiny_model

        build_tiny_model(tiny)
    return tiny


def default_model_dir() -> Path:
    """The embedded default's real model (``$SGLANG_GATEWAY_DEFAULT_MODEL``, else ``.cache/smollm2-instruct``), built
    if missing (offline, from the pinned wheel: about a minute)."""
    from launch.instruct_model import build_instruct_model

    model = os.environ.setdefault("SGLANG_GATEWAY_DEFAULT_MODEL", str(REPO / ".cache" / "smollm2-instruct"))
    return build_instruct_model(model, progress=lambda line: print(f"  {line}", file=sys.stderr))


# The real CPU engines ``--upstream`` names: (the config it runs, what builds its model, what the console says)
ENGINES: dict[str, tuple[str, Callable[[], Path], str]] = {
    "sglang": ("tiny-cpu.yaml", tiny_model_dir, "tiny model; 30-60 s"),
    "sglang-default": ("smollm2-cpu.yaml", default_model_dir, "the default model, SmolLM2-135M-Instruct; 30-60 s"),
}


@contextmanager
def sglang_engine(logs: Path, name: str = "sglang") -> Iterator[tuple[str, object]]:
    """The real SGLang CPU engine ``name`` of :data:`ENGINES` (the tiny model by default), via launch.EngineProcess."""
    from launch.config import load_config
    from launch.process import EngineProcess

    config, build, _ = ENGINES[name]
    build()
    deployment = load_config(REPO / "configs" / config)
    name = next(iter(deployment.managed()))
    engine = EngineProcess("bench", deployment.engine(name), log_dir=logs)
    with engine:  # starts, waits for /health, stops the process group and its /dev/shm files
        yield engine.url, engine


def router_argv(
    worker_urls: list[str], port: int, metrics_port: int, policy: str = "round_robin", extra_args: tuple[str, ...] = ()
) -> list[str]:
    """SGLang's router in front of ``worker_urls``, bound to loopback (its Prometheus port too)."""
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--policy", policy,
        "--log-level", "warn", "--worker-urls", *worker_urls, *extra_args,
    ]  # fmt: skip


@contextmanager
def router(
    worker_urls: list[str], logs: Path, policy: str = "round_robin", extra_args: tuple[str, ...] = ()
) -> Iterator[tuple[str, Child]]:
    """SGLang's router (PyPI ``sglang-router``) in front of ``worker_urls``, ready once a worker is healthy.

    ``HF_HUB_OFFLINE=1``: the router loads the tokenizer of the model its workers report (when it is a local
    directory) and must never fetch one from the hub.
    """
    port = pick_free_port()
    argv = router_argv(worker_urls, port, pick_free_port(), policy, extra_args)
    child = Child("sglang-router", argv, logs / "router.log", {"HF_HUB_OFFLINE": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readiness", child, 120)
        yield url, child
    finally:
        child.stop(grace_s=15)


def find_py_spy() -> str | None:
    """``$BENCH_PY_SPY``, the venv's ``py-spy``, or one on PATH."""
    if os.environ.get("BENCH_PY_SPY"):
        return os.environ["BENCH_PY_SPY"]
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


class Profiler:
    """py-spy (``record``, nonblocking) or pyinstrument-less fallback: attach to a running pid."""

    def __init__(self, pid: int, out: Path, rate: int = 250) -> None:
        self.out = out
        exe_path = find_py_spy()
        if not exe_path:
            raise RuntimeError("py-spy is not installed (pip install py-spy, or set BENCH_PY_SPY to its path)")
        self.svg = out.with_suffix(".svg")
        self.raw = out.with_suffix(".txt")
        self.children = [
            Child(
                "py-spy",
                [exe_path, "record", "--pid", str(pid), "--rate", str(rate), "--nonblocking", "-f", fmt, "-o", str(path)],
                out.with_suffix(log_suffix),
            )
            for fmt, path, log_suffix in (("flamegraph", self.svg, ".svg.log"), ("raw", self.raw, ".raw.log"))
        ]
        time.sleep(0.5)  # attach before the load starts

    def stop(self) -> None:
        for child in self.children:
            child.stop(grace_s=20, sig=signal.SIGINT)  # py-spy writes its output on SIGINT


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_cpu_s(pgid: int) -> float:
    """User+system CPU seconds of every live process in process group ``pgid`` (from /proc)."""
    return sum(group_cpu_split_s(pgid))


def group_cpu_split_s(pgid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of every live process in process group ``pgid``: the system part is the
    kernel's work for the process (socket reads and writes), which any proxy pays alike."""
    user = system = 0
    for pid in group_pids(pgid):
        fields = stat_fields(pid)
        if fields is not None:
            user += int(fields[11])
            system += int(fields[12])
    return user / _TICK, system / _TICK


def server_tree_cpu_s(pid: int) -> float:
    """User+system CPU seconds of a server that forks a process per connection, each in a session of its own
    (PostgreSQL's postmaster: its group holds only itself): its own, its live children's, and what its ended
    children used (which it reaped: cutime/cstime)."""
    fields = stat_fields(pid)
    if fields is None:
        return 0.0
    ticks = sum(int(fields[index]) for index in (11, 12, 13, 14))
    for child in child_pids(pid):
        child_fields = stat_fields(child)
        if child_fields is not None:
            ticks += int(child_fields[11]) + int(child_fields[12])
    return ticks / _TICK
