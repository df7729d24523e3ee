"""Shared fixtures: the tiny model and one real SGLang CPU engine per test session.

SGLang takes ~30 s to start on CPU, so engines are session-scoped and started only by the tests
that ask for them. Every engine started here is stopped (process group, /dev/shm files) at the end.

The ``engine`` marker is derived, not written by hand: a test whose fixtures (directly or through
other fixtures) include ``starts_engine`` is marked ``engine``, so ``-m "not engine"`` runs no
SGLang engine at all. ``tiny_engine`` and every fixture that starts an engine request it; a test
that starts one itself says so with ``@pytest.mark.usefixtures("starts_engine")``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.config import DeploymentConfig, EngineConfig, load_config
from launch.lifecycle import start_ready
from launch.process import EngineProcess
from tests.leaks import TREE_CACHES, untracked_in_tree
from tests.postgres import PostgresServer, own_postgres

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "tiny-cpu.yaml"
TINY_MODEL = Path(os.environ.get("SGLANG_GATEWAY_TINY_MODEL", REPO / ".cache" / "tiny-model"))
DEFAULT_CONFIG = REPO / "configs" / "smollm2-cpu.yaml"
DEFAULT_MODEL = Path(os.environ.get("SGLANG_GATEWAY_DEFAULT_MODEL", REPO / ".cache" / "smollm2-instruct"))
ENGINE_FIXTURE = "starts_engine"
if os.environ.get("PYTEST_XDIST_WORKER") is not None:  # make test: three workers share two cores
    # Each CPU engine's torch would run one OpenMP thread per core, whose spin-waits take the cores from the other
    # workers' engines: one thread per engine (inherited by every engine the tests start). The tiny engine's 1,800
    # tokens took 10.0 s of CPU with two threads (5.2 s wall) and 5.9 s with one (5.9 s wall), measured quiet.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
SLOWEST_MODULES = (
    "tests/model_code/test_gpu_stack_resolves.py",
    "tests/gateway/test_swap.py",
    "tests/cli/test_start_faults.py",
    "tests/benchmarks/test_bench_cli.py",
    "tests/model_code/test_tools_mlflow.py",
    "tests/model_code/test_start_faults_mlflow.py",
    "tests/model_code/test_replicas.py",
    "tests/gateway/test_residency_engine.py",
    "tests/gateway/test_workers.py",
    "tests/gateway/test_workers_isolation.py",
    "tests/benchmarks/test_affinity.py",
    "tests/gateway/test_residency.py",
    "tests/gateway/test_replicas.py",
    "tests/gateway/test_swap_fake_engine.py",
    "tests/gateway/test_router_upstream.py",
    "tests/model_code/test_shared_serving.py",
    "tests/launch/test_shared_engine.py",
    "tests/gateway/test_watchdog_engine.py",
    "tests/gateway/test_router_fields.py",
    "tests/deploy/test_kubernetes.py",
    "tests/gateway/test_tools_engine.py",
    "tests/gateway/test_rolling_restart.py",
    "tests/batches/test_batch_faults.py",
    "tests/model_code/test_managed_engine.py",
    "tests/cli/test_cli_launch.py",
    "tests/gateway/test_engine_fuzz.py",
    "tests/launch/test_process.py",
    "tests/cli/test_cli_doctor.py",
    "tests/docs/test_agent_app.py",
    "tests/docs/test_readme_mlflow.py",
    "tests/tenants/test_accounting.py",
    "tests/gateway/test_adapters_engine.py",
)
"""The modules that take longest (measured with ``--durations``), slowest first. With pytest-xdist (``make
test``), whole modules go to the workers in collection order, so these are collected first: a long module
started last would leave the other worker idle meanwhile. A scheduling hint only: tests run in any order
(``make test-random`` shuffles after this)."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``engine`` every test whose fixture closure includes ``starts_engine`` (before ``-m`` selects);
    under pytest-xdist, collect :data:`SLOWEST_MODULES` first."""
    for item in items:
        if ENGINE_FIXTURE in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (every worker sorts alike: the order is fixed)
        rank = {module: index for index, module in enumerate(SLOWEST_MODULES)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


_TREE_BEFORE = pytest.StashKey[set[str] | None]()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the whole run's process (with pytest-xdist: the controller)
        session.config.stash[_TREE_BEFORE] = untracked_in_tree(REPO)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that left files in the working tree fails, naming them (an MLflow experiment without an artifact
    location of its own writes its traces under ./mlruns: a run once left them there)."""
    before = session.config.stash.get(_TREE_BEFORE, None)
    after = untracked_in_tree(REPO) if before is not None else None
    left = sorted(after - before - TREE_CACHES) if after is not None and before is not None else []
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_sep("=", f"the tests left these in the working tree: {', '.join(left)}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Gateways started from a config file keep their state under $XDG_STATE_HOME (see
    ``gateway.config.default_state_dir``): a temporary one for the session, never the user's."""
    before = os.environ.get("XDG_STATE_HOME")
    home = os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))
    yield Path(home)
    if before is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = before


@pytest.fixture(scope="session")
def starts_engine() -> None:
    """Request this (directly or through a fixture) in anything that starts a real SGLang engine."""


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny offline model (built by `make test`; built here too if missing)."""
    from launch.tiny_model import build_tiny_model

    return build_tiny_model(TINY_MODEL)


@pytest.fixture(scope="session")
def tiny_deployment(tiny_model_dir: Path) -> DeploymentConfig:
    """configs/tiny-cpu.yaml, pointing at the tiny model."""
    os.environ.setdefault("SGLANG_GATEWAY_TINY_MODEL", str(tiny_model_dir))
    return load_config(TINY_CONFIG)


@pytest.fixture(scope="session")
def tiny_engine_config(tiny_deployment: DeploymentConfig) -> EngineConfig:
    return tiny_deployment.engine("tiny")


@pytest.fixture(scope="session")
def tiny_engine(
    starts_engine: None, tiny_engine_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """One real SGLang engine on CPU serving the tiny model as `tiny`, shared by the whole session.

    Tests must not stop or kill it; tests that break an engine start their own.
    """
    yield from _session_engine("tiny", tiny_engine_config, tmp_path_factory)


def _session_engine(name: str, config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    # as the launcher starts one: a picked port another process took first is picked again
    engine = start_ready(name, config, log_dir=tmp_path_factory.mktemp("engine-logs"))
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default's real model, SmolLM2-135M-Instruct (built by `make test`; built here too if missing)."""
    from launch.instruct_model import build_instruct_model

    return build_instruct_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_deployment(default_model_dir: Path) -> DeploymentConfig:
    """configs/smollm2-cpu.yaml, pointing at the real model."""
    os.environ.setdefault("SGLANG_GATEWAY_DEFAULT_MODEL", str(default_model_dir))
    return load_config(DEFAULT_CONFIG)


@pytest.fixture(scope="session")
def smollm2_engine(
    starts_engine: None, default_deployment: DeploymentConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """One real SGLang engine on CPU serving the embedded default's model as `smollm2` (a model that answers, calls
    tools and keeps to schemas), shared by the session's tests that need right answers. Tests must not stop it."""
    yield from _session_engine("smollm2", default_deployment.engine("smollm2"), tmp_path_factory)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server of the session's own (tests/postgres.py), started on first use; skipped, saying why,
    where none can run. Tests may stop and start it; each leaves it running."""
    yield from own_postgres()
