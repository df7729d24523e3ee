"""The start faults of the catalogue (docs/operations.md, "When a start or a reload fails") as a notebook meets them:
``mlflow.pyfunc.load_model`` of a logged model whose engine cannot start raises the error ``sglang-gateway serve``
prints, the same first line naming the model and the cause (then, where an engine ran, the last lines of its
log), and leaves nothing behind: no engine host, no engine, no shared-engine directory, no ``/dev/shm`` file.

Each fault is logged as a model whose weights (the ``llm-model`` artifact) are the tiny model's files, broken in
``tmp_path``. Most are caught by the preflight before any engine starts, in both ``engine_sharing`` modes (the
default ``shared`` runs it in the engine host the load starts, ``per_process`` in the loading process). Two
faults start a real SGLang engine that dies (one per mode); the engine killed while it starts is a FAKE engine
(tests/fake_engine.py) that takes 60 s to listen, so that the kill lands during its start whatever the load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlflow
import pytest
from loguru import logger

from launch.config import EngineConfig
from launch.preflight import PreflightError
from launch.process import EngineError
from launch.procgroup import child_pids, cmdline
from launch.sglang_versions import installed_sglang
from model_code import log_model
from tests.fake_engine import fake_engine_python
from tests.leaks import SETTLE_S, LeakCheck, leaves_nothing
from tests.model_code.helpers import engine_children
from tests.servers import CLI, REPO
from tests.waiting import wait_until

MODES = ("shared", "per_process")
HOST_STARTED = re.compile(r"engine host started \(pid (\d+)\) in (\S+)")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def weights(base: Path, tiny_model_dir: Path, name: str, config: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of the tiny model's files (copies: MLflow refuses to log links that point outside the directory),
    with ``config`` as its config.json and without the files in ``drop``."""
    model = base / name
    model.mkdir()
    for source in tiny_model_dir.iterdir():
        if source.name not in drop:
            shutil.copy(source, model / source.name)
    if config is not None:
        (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def logged(mlflow_store: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], str]:
    """``logged(fault, mode)``: the URI of a ``responses_agent`` model with that fault in that ``engine_sharing`` mode
    (logged once per module)."""
    base = tmp_path_factory.mktemp("faulty-models")
    no_model = base / "not-a-model"
    no_model.mkdir()
    (no_model / "README.md").write_text("weights go here\n")
    fake_model = base / "fake-model"  # the FAKE engine reads nothing but a config.json
    fake_model.mkdir()
    (fake_model / "config.json").write_text("{}")
    fake = {"model_path": str(fake_model), "python": str(fake_engine_python(base)), "env": {"FAKE_ENGINE_START_S": "60"}}
    faults: dict[str, Callable[[], tuple[dict[str, Any], Path | None]]] = {
        "model path missing": lambda: ({"model_path": str(base / "nowhere")}, None),
        "not a model directory": lambda: ({}, no_model),
        "tokenizer missing": lambda: ({}, weights(base, tiny_model_dir, "no-tokenizer", drop=TOKENIZER_FILES)),
        "unknown flag": lambda: ({"extra_args": ["--max-runing-requests", "4"]}, tiny_model_dir),
        "config {}": lambda: ({}, weights(base, tiny_model_dir, "empty-config", {})),
        "wrong-typed flag": lambda: ({"extra_args": ["--max-running-requests", "lots"]}, tiny_model_dir),
        "killed while starting": lambda: (fake, None),
    }
    built: dict[str, tuple[dict[str, Any], Path | None]] = {}
    uris: dict[tuple[str, str], str] = {}

    def log(fault: str, mode: str) -> str:
        if (fault, mode) not in uris:
            engine, model_path = built[fault] if fault in built else built.setdefault(fault, faults[fault]())
            section = {"model_path": str(tiny_model_dir), "device": "cpu", "dtype": "float32", "max_total_tokens": 4096, "startup_timeout_s": 300, **engine}
            config = {"models": {"smol": {"engine": section}}, "mlflow": {"engine_sharing": mode}}
            with mlflow.start_run():
                uris[fault, mode] = log_model(config, flavor="responses_agent", model_path=model_path, flashinfer=None).model_uri
        return uris[fault, mode]

    return log


class FailedLoad:
    """What a failed ``load_model`` raised, and what it logged (the engine hosts it started among it)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.messages: list[str] = []

    @property
    def hosts(self) -> list[tuple[int, Path]]:
        """(pid, shared-engine directory) of each engine host the load started."""
        return [(int(m.group(1)), Path(m.group(2))) for line in self.messages if (m := HOST_STARTED.search(line))]

    @property
    def lines(self) -> list[str]:
        return str(self.error).splitlines()


class NothingLeft:
    """The leak check of one test, and the shared-engine directories that must be gone after it."""

    def __init__(self, check: LeakCheck) -> None:
        self.check = check
        self.key_dirs: list[Path] = []


@pytest.fixture
def nothing_left() -> Iterator[NothingLeft]:
    """No process group, ``/dev/shm`` file or engine temporary directory left; no engine host of this process left,
    and every shared-engine directory the test's hosts used removed."""
    with leaves_nothing() as check:
        left = NothingLeft(check)
        yield left
    for key_dir in left.key_dirs:
        wait_until(lambda key_dir=key_dir: not key_dir.exists(), f"the shared-engine directory {key_dir} to go", SETTLE_S, every_s=0.25)
    hosts = lambda: [pid for pid in child_pids(os.getpid()) if "launch.engine_host" in cmdline(pid)]  # noqa: E731
    wait_until(lambda: not hosts(), lambda: f"engine hosts of this process still running: {hosts()}", SETTLE_S, every_s=0.25)


def load_failing(uri: str, left: NothingLeft, result: FailedLoad | None = None) -> FailedLoad:
    """``mlflow.pyfunc.load_model(uri)``, which must raise; every engine host it started is watched by ``left``."""
    result = result or FailedLoad()
    sink = logger.add(lambda message: result.messages.append(message.record["message"]), level="INFO")
    try:
        with pytest.raises(Exception) as raised:
            mlflow.pyfunc.load_model(uri)
        result.error = raised.value
    finally:
        logger.remove(sink)
        for pid, key_dir in result.hosts:
            left.check.watch(pid)
            left.key_dirs.append(key_dir)
    return result


# ------------------------------------------------------------------ caught before any engine starts (preflight)


@pytest.mark.parametrize("mode", MODES)
def test_load_model_of_a_missing_model_path_raises_the_preflight_line(logged, nothing_left, mode: str) -> None:
    """The config's ``model_path`` (no weights logged with the model) does not exist where the model is loaded."""
    failed = load_failing(logged("model path missing", mode), nothing_left)
    assert isinstance(failed.error, PreflightError), repr(failed.error)
    assert re.fullmatch(r"model smol: model_path /\S+/nowhere: no such directory, and not a Hugging Face id \(org/name\)", str(failed.error)), str(failed.error)
    assert len(failed.hosts) == (1 if mode == "shared" else 0), failed.messages


@pytest.mark.parametrize("mode", MODES)
def test_load_model_of_weights_without_config_json_raises_the_preflight_line(logged, nothing_left, mode: str) -> None:
    failed = load_failing(logged("not a model directory", mode), nothing_left)
    assert isinstance(failed.error, PreflightError), repr(failed.error)
    path = re.fullmatch(r"model smol: model_path (/\S+/not-a-model): no config\.json in this directory", str(failed.error))
    assert path and Path(path.group(1)).is_dir(), str(failed.error)  # the logged weights, where load_model put them


@pytest.mark.parametrize("mode", MODES)
def test_load_model_of_weights_without_a_tokenizer_raises_the_preflight_line(logged, nothing_left, mode: str) -> None:
    failed = load_failing(logged("tokenizer missing", mode), nothing_left)
    assert isinstance(failed.error, PreflightError), repr(failed.error)
    assert re.fullmatch(
        r"model smol: model_path /\S+/no-tokenizer: no tokenizer in this directory \(tokenizer\.json, tokenizer_config\.json, "
        r"tokenizer\.model\.\.\.\): copy the model's tokenizer files there, or set tokenizer_path",
        str(failed.error),
    ), str(failed.error)


@pytest.mark.parametrize("mode", MODES)
def test_load_model_with_an_unknown_sglang_flag_raises_the_preflight_line(logged, nothing_left, tiny_model_dir, mode: str) -> None:
    failed = load_failing(logged("unknown flag", mode), nothing_left)
    version = installed_sglang(EngineConfig(model_path=str(tiny_model_dir)).python_executable)
    assert isinstance(failed.error, PreflightError), repr(failed.error)
    assert str(failed.error) == f"model smol: extra_args: --max-runing-requests: SGLang {version} has no such flag (did you mean --max-running-requests?)"


def test_serve_model_uri_of_weights_without_a_tokenizer_exits_2_with_the_preflight_line(logged, nothing_left) -> None:
    """``sglang-gateway serve --model-uri`` loads the model the same way: the CLI's exit 2 and its one line (it
    was exit 1 and ``engine 'smol': model smol: ...`` while the shared host's words wrapped the preflight's)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}
    done = subprocess.run([*CLI, "serve", "--model-uri", logged("tokenizer missing", "shared"), "--port", "0"],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env, check=False)  # fmt: skip
    assert HOST_STARTED.search(done.stderr), done.stderr[-3000:]  # the default shared mode: its host is watched
    for host in HOST_STARTED.finditer(done.stderr):
        nothing_left.check.watch(int(host.group(1)))
        nothing_left.key_dirs.append(Path(host.group(2)))
    errors = [line.removeprefix("error: ") for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert re.fullmatch(r"model smol: model_path /\S+/no-tokenizer: no tokenizer in this directory .*, or set tokenizer_path", errors[0]), errors


# ------------------------------------------------------------------ engines that die while starting (real SGLang)


@pytest.mark.usefixtures("starts_engine")
def test_load_model_of_a_model_whose_config_is_empty_raises_sglangs_error_and_the_log_tail(logged, nothing_left) -> None:
    """``shared`` (the default): the engine host's engine dies on the config; the error is the CLI's, not the host's
    words around it, and carries the tail as data too."""
    failed = load_failing(logged("config {}", "shared"), nothing_left)
    error, lines = failed.error, failed.lines
    assert isinstance(error, EngineError), repr(error)
    assert re.match(r"engine 'smol' exited with code 1 while starting: ValueError: Unrecognized model in /\S+/empty-config\. ", lines[0]), lines[:2]
    assert "(full log: " in lines[0] and lines[1] == "  last lines of the engine log:", lines[:2]
    assert any("Traceback (most recent call last)" in line for line in lines[2:]), lines  # the engine's, as it logged it
    assert lines[-1].strip().startswith("ValueError: Unrecognized model"), lines[-3:]
    assert error.returncode == 1 and error.log_tail[-1].startswith("ValueError: Unrecognized model"), (error.returncode, error.log_tail[-3:])
    assert error.log_file is not None and error.log_file.is_file() and f"(full log: {error.log_file})" in lines[0]
    assert len(failed.hosts) == 1


@pytest.mark.usefixtures("starts_engine")
def test_load_model_with_a_wrong_typed_sglang_flag_raises_sglangs_parser_error(logged, nothing_left) -> None:
    """``per_process``: the engine is this process's, its start fails as ``sglang-gateway launch``'s does."""
    before = set(engine_children())
    failed = load_failing(logged("wrong-typed flag", "per_process"), nothing_left)
    error, lines = failed.error, failed.lines
    assert isinstance(error, EngineError) and error.returncode == 2, repr(error)
    assert lines[0].startswith(
        "engine 'smol' exited with code 2 while starting: SGLang refused its command line: argument --max-running-requests: invalid int value: 'lots'"
    ), lines[0]
    assert lines[1] == "  last lines of the engine log:" and lines[-1].strip().endswith("invalid int value: 'lots'"), lines[-3:]
    assert set(engine_children()) == before


# ------------------------------------------------------------------ the engine killed while it starts (FAKE engine)


def test_load_model_whose_engine_is_killed_while_it_starts_names_the_signal(logged, nothing_left) -> None:
    uri = logged("killed while starting", "shared")
    failed = FailedLoad()
    with ThreadPoolExecutor(max_workers=1) as pool:
        loading = pool.submit(load_failing, uri, nothing_left, failed)
        host = wait_until(lambda: failed.hosts, lambda: f"no engine host started: {failed.messages}", 120, every_s=0.1)[0][0]
        engine = wait_until(lambda: engine_children(host), "the engine host to start its engine", 120, every_s=0.1)[0]
        nothing_left.check.watch(engine)
        os.kill(engine, signal.SIGKILL)  # the OOM killer's way
        loading.result(timeout=120)
    assert isinstance(failed.error, EngineError) and failed.error.returncode == -9, repr(failed.error)
    assert failed.lines[0].startswith(
        "engine 'smol' exited with code -9 while starting: killed by SIGKILL (the kernel's out-of-memory killer, or another process)"
    ), failed.lines[:3]
