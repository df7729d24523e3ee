"""The mistakes users meet when a deployment starts (the catalogue in docs/operations.md): for each, the real CLI's
exit status, one line naming the model and the cause, and where an engine ran, its log's last lines.

Most are caught before any engine starts (preflight, config validation): those runs take a second or two. The
engine failures are real SGLang engines on a tiny model whose ``config.json`` is wrong: each dies while its
main process reads the config, seconds after its imports. The engine killed during its start is a FAKE engine
(tests/fake_engine.py) that takes 60 s to listen, so that the kill lands during the start whatever the load.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from launch.config import EngineConfig
from launch.procgroup import child_pids, cmdline
from launch.sglang_versions import installed_sglang
from tests.fake_engine import fake_engine_python
from tests.gateway_server import KEY, auth
from tests.leaks import leaves_nothing
from tests.servers import CLI, REPO, ServerProcess, server_process
from tests.waiting import wait_until

ADMIN = "start-faults-admin-key"


def model_dir(tmp_path: Path, tiny_model_dir: Path, name: str, config: dict[str, Any] | None = None, *, drop: tuple[str, ...] = ()) -> Path:
    """The tiny model's files (linked), with ``config`` as its config.json and without the files in ``drop``."""
    model = tmp_path / name
    model.mkdir()
    for source in tiny_model_dir.iterdir():
        if source.name not in drop and not (config is not None and source.name == "config.json"):
            (model / source.name).symlink_to(source)
    if config is not None:
        (model / "config.json").write_text(json.dumps(config))
    return model


def tiny_config(tiny_model_dir: Path) -> dict[str, Any]:
    return json.loads((tiny_model_dir / "config.json").read_text())


def deployment(tmp_path: Path, model_path: Path | str, gateway: dict[str, Any] | None = None, **engine: Any) -> Path:
    """A one-model deployment ``smol`` on the CPU (the tiny model's settings, ``engine`` over them)."""
    section = {"model_path": str(model_path), "device": "cpu", "dtype": "float32", "max_total_tokens": 4096, "startup_timeout_s": 300, **engine}
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"models": {"smol": {"engine": section}}, "gateway": {"host": "127.0.0.1", "port": 0, **(gateway or {})}}))
    return path


def run_cli(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO, check=False)


def errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The ``error:`` lines a command printed (the log lines of a serve run come before them)."""
    return [line.removeprefix("error: ") for line in done.stderr.splitlines() if line.startswith("error: ")]


def assert_no_traceback(done: subprocess.CompletedProcess[str]) -> None:
    """No traceback of the gateway's own: an engine's, quoted in its log tail, is indented under ``error:``."""
    outside_tail = [line for line in done.stderr.splitlines() if not line.startswith("error: ")]
    assert not [line for line in outside_tail if "Traceback" in line], done.stderr[-3000:]


# ------------------------------------------------------------------ caught before any engine starts


def test_a_missing_model_path_or_a_directory_without_config_is_one_line(tmp_path: Path) -> None:
    missing = deployment(tmp_path, tmp_path / "nowhere")
    for command in ("check", "serve", "launch"):
        done = run_cli(command, str(missing), timeout_s=120)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert errors(done)[-1] == f"model smol: model_path {tmp_path / 'nowhere'}: no such directory, and not a Hugging Face id (org/name)", (command, done.stderr[-2000:])
        assert_no_traceback(done)
    (tmp_path / "empty").mkdir()
    done = run_cli("serve", str(deployment(tmp_path, tmp_path / "empty")), timeout_s=120)
    assert done.returncode == 2 and errors(done) == [f"model smol: model_path {tmp_path / 'empty'}: no config.json in this directory"], done.stderr[-2000:]


def test_a_model_without_its_tokenizer_is_refused_by_check_serve_and_doctor(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = model_dir(tmp_path, tiny_model_dir, "no-tokenizer", drop=("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"))
    config = deployment(tmp_path, model)
    line = (f"model smol: model_path {model}: no tokenizer in this directory (tokenizer.json, tokenizer_config.json, tokenizer.model...): "
            "copy the model's tokenizer files there, or set tokenizer_path")  # fmt: skip
    for command in ("check", "serve"):
        done = run_cli(command, str(config), timeout_s=120)
        assert done.returncode == 2 and line in errors(done), (command, done.stderr[-2000:])
    doctor = run_cli("doctor", str(config), "--model", "smol", "--json", str(tmp_path / "doctor.json"))
    assert doctor.returncode == 1, doctor.stdout[-3000:]
    engine_check = next(c for c in json.loads((tmp_path / "doctor.json").read_text())["checks"] if c["name"].startswith("engine smol"))
    assert (engine_check["level"], engine_check["detail"]) == ("error", line), engine_check


def test_an_unknown_sglang_flag_is_refused_naming_the_closest(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = deployment(tmp_path, tiny_model_dir, extra_args=["--max-runing-requests", "4"])
    version = installed_sglang(EngineConfig(model_path=str(tiny_model_dir)).python_executable)
    line = f"model smol: extra_args: --max-runing-requests: SGLang {version} has no such flag (did you mean --max-running-requests?)"
    for command in ("check", "serve"):
        done = run_cli(command, str(config), timeout_s=120)
        assert done.returncode == 2 and line in errors(done), (command, done.stderr[-2000:])

def test_an_engine_port_or_the_gateway_port_taken_is_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        engine_port = run_cli("serve", str(deployment(tmp_path, tiny_model_dir, port=port)), timeout_s=120)
        assert engine_port.returncode == 2, engine_port.stderr[-2000:]
        assert errors(engine_port) == [f"model smol: port {port} on 127.0.0.1 is already in use (set port: 0 to pick a free one)"], engine_port.stderr[-2000:]
        config = deployment(tmp_path, tiny_model_dir, gateway={"port": port})
        gateway_port = run_cli("serve", str(config), timeout_s=120)
        assert gateway_port.returncode == 2, gateway_port.stderr[-2000:]
        assert errors(gateway_port) == [f"{config}: gateway.port: port {port} on 127.0.0.1 is already in use (or use --port)"], gateway_port.stderr[-2000:]


def test_max_total_tokens_beyond_the_memory_is_warned_about_by_check(tmp_path: Path, tiny_model_dir: Path) -> None:
    done = run_cli("check", str(deployment(tmp_path, tiny_model_dir, max_total_tokens=10**9)))
    assert done.returncode == 0, done.stderr  # SGLang starts with the tokens that fit: a warning, not a refusal
    assert "warning: model smol: max_total_tokens 1000000000: its KV cache takes about 954 GiB (1024 bytes a token)" in done.stderr, done.stderr


def test_a_malformed_usage_database_url_is_refused_by_check_and_serve_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({
        "models": {"a": {"url": "http://127.0.0.1:9"}},
        "gateway": {"port": 0, "usage": {"database_url": "postgresql+psycopg://ledger:s3cret@db.internal:pg/usage"}},
    }))  # fmt: skip
    line = f"{config}: gateway.usage.database_url: the port after the host must be a number (host:5432)"
    for command in ("check", "serve"):
        done = run_cli(command, str(config), timeout_s=120)
        assert (done.returncode, errors(done)) == (2, [line]), (command, done.stderr[-3000:])
        assert "s3cret" not in done.stderr + done.stdout


# ------------------------------------------------------------------ engines that fail while starting (real SGLang)


@pytest.mark.usefixtures("starts_engine")
def test_serve_a_model_whose_config_is_empty_exits_1_with_sglangs_error_and_the_log_tail(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``serve`` once exited 0 without a word (the boot's fail-fast abort was taken for a stop request)."""
    model = model_dir(tmp_path, tiny_model_dir, "empty-config", {})
    with leaves_nothing():
        done = run_cli("serve", str(deployment(tmp_path, model)))
    assert done.returncode == 1, done.stderr[-3000:]
    lines = errors(done)
    assert lines[0].startswith(f"engine 'smol' exited with code 1 while starting: ValueError: Unrecognized model in {model}."), lines[:2]
    assert "(full log: " in lines[0] and lines[1] == "  last lines of the engine log:", lines[:2]
    assert any("Traceback (most recent call last)" in line for line in lines[2:]), lines  # the engine's, as it logged it
    assert lines[-1].strip().startswith("ValueError: Unrecognized model"), lines[-3:]
    assert_no_traceback(done)


@pytest.mark.usefixtures("starts_engine")
def test_serve_a_config_without_architectures_names_sglangs_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = tiny_config(tiny_model_dir)
    del config["architectures"]
    with leaves_nothing():
        done = run_cli("serve", str(deployment(tmp_path, model_dir(tmp_path, tiny_model_dir, "no-architectures", config))))
    assert done.returncode == 1, done.stderr[-3000:]
    first = errors(done)[0]
    assert first.startswith("engine 'smol' exited with code 1 while starting: TypeError: 'NoneType' object is not subscriptable"), first
    assert "last lines of the engine log:" in done.stderr, done.stderr[-3000:]


@pytest.mark.usefixtures("starts_engine")
def test_launch_a_wrong_typed_sglang_flag_names_sglangs_parser_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    with leaves_nothing():
        done = run_cli("launch", str(deployment(tmp_path, tiny_model_dir, extra_args=["--max-running-requests", "lots"])))
    assert done.returncode == 1, done.stderr[-3000:]
    first = errors(done)[0]
    assert first.startswith(
        "engine 'smol' exited with code 2 while starting: SGLang refused its command line: argument --max-running-requests: invalid int value: 'lots'"
    ), first
    assert errors(done)[-1].strip().endswith("invalid int value: 'lots'"), errors(done)[-3:]


# ------------------------------------------------------------------ an engine killed while it starts (FAKE engine)


def test_serve_an_engine_killed_while_it_starts_exits_1_naming_the_signal(tmp_path: Path) -> None:
    model = tmp_path / "fake-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = deployment(tmp_path, model, python=str(fake_engine_python(tmp_path)), env={"FAKE_ENGINE_START_S": "60"})
    with leaves_nothing() as check:
        server = ServerProcess([*CLI, "serve", str(config)], log_path=tmp_path / "serve.log")
        check.watch(server.pid)
        try:
            engines = wait_until(
                lambda: [pid for pid in child_pids(server.pid) if "sglang.launch_server" in cmdline(pid)],
                lambda: f"no engine started: {server.log(2000)}", 60, every_s=0.1,
            )  # fmt: skip
            os.kill(engines[0], signal.SIGKILL)  # the OOM killer's way
            assert server.proc.wait(timeout=60) == 1, server.log(3000)
        finally:
            server.stop()
    lines = [line.removeprefix("error: ") for line in server.log().splitlines() if line.startswith("error: ")]
    assert lines and lines[0].startswith(
        "engine 'smol' exited with code -9 while starting: killed by SIGKILL (the kernel's out-of-memory killer, or another process)"
    ), server.log(3000)


# ------------------------------------------------------------------ a reload to a model that cannot start (FAKE engines)


def test_a_sighup_reload_to_a_model_that_cannot_start_keeps_the_old_engine_and_shows_why(tmp_path: Path) -> None:
    """``serve``, then the YAML points the model at a directory whose config.json is broken, then SIGHUP: the old
    engine serves on, and the admin API (what the status page shows: the model's last error, the reload's report
    with the engine's log tail, the events list) and the log say why. FAKE engines: the reload is the gateway's."""
    python = fake_engine_python(tmp_path)
    good, broken = tmp_path / "good-model", tmp_path / "broken-model"
    for model, text in ((good, "{}"), (broken, "{not json")):
        model.mkdir()
        (model / "config.json").write_text(text)
    keys = {"api_keys": [KEY], "admin_keys": [ADMIN]}
    config = deployment(tmp_path, good, gateway=keys, python=str(python))
    with server_process([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / "serve.log", ready_path="/ready", timeout_s=120) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            before = http.get("/admin/models", headers=auth(ADMIN)).json()["models"][0]
            deployment(tmp_path, broken, gateway=keys, python=str(python))  # the same file, rewritten
            os.kill(server.pid, signal.SIGHUP)
            server.wait_log(r"reload \(SIGHUP\): model smol: .*it keeps its previous backend", 120)
            admin = http.get("/admin/models", headers=auth(ADMIN)).json()
            model = admin["models"][0]
            assert (model["state"], model["engine"]["pid"]) == ("ready", before["engine"]["pid"]), model
            cause = "engine 'smol' exited with code 1 while starting: JSONDecodeError: Expecting property name enclosed in double quotes"
            assert cause in model["last_error"], model["last_error"]
            reported = admin["last_reload"]["models"]["smol"]
            assert reported["ok"] is False and cause in reported["error"] and reported["log_tail"][-1].startswith("JSONDecodeError"), reported
            swap = admin["events"][0]
            assert (swap["kind"], swap["model"], swap["ok"]) == ("swap", "smol", False) and cause in swap["detail"], swap
            answer = http.post("/v1/chat/completions", headers=auth(KEY), json={"model": "smol", "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200, answer.text  # the old engine serves on
        assert server.proc.poll() is None


# ------------------------------------------------------------------ the catalogue


def test_every_row_of_the_catalogue_in_operations_md_names_tests_that_exist() -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("## When a start or a reload fails", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith(("| Mistake", "|---"))]
    assert len(rows) >= 17, rows
    for row in rows:
        cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row.rsplit(" | ", 1)[1])
        assert cited, f"a row without a test: {row[:80]}"
        for path, name in cited:
            assert re.search(rf"^(?:async )?def {name}\(", (REPO / path).read_text(), re.MULTILINE), f"{path}::{name} (cited in docs/operations.md) does not exist"
