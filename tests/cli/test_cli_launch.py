"""`sglang-gateway check` and `launch`, run as a user runs them (subprocess, real engine)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from launch.procgroup import group_pids
from launch.shm import SHM_DIR, owned_shm_files, shm_in_use
from tests.fake_engine import fake_engine_python
from tests.leaks import leaves_nothing
from tests.servers import CLI, REPO, ServerProcess
from tests.waiting import wait_until

READY = r"engine tiny \(pid (\d+)\) ready at (http://\S+)"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=REPO, env=env, check=False)


def test_check_prints_the_exact_command_line(tiny_model_dir: Path) -> None:
    env = {**os.environ, "SGLANG_GATEWAY_TINY_MODEL": str(tiny_model_dir)}
    result = run_cli("check", "configs/tiny-cpu.yaml", env=env)
    assert result.returncode == 0, result.stderr
    command = [line for line in result.stdout.splitlines() if "sglang.launch_server" in line]
    assert len(command) == 1
    assert "SGLANG_USE_CPU_ENGINE=1" in command[0]
    assert f"--model-path {tiny_model_dir}" in command[0] and "--served-model-name tiny" in command[0]


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("models:\n  m:\n    engine:\n      model_path: org/m\n      tp_size: 0\n", r"models\.m\.engine\.tp_size: Input should be greater than or equal to 1"),
        ("models:\n  m:\n    engine:\n      model_path: /nope/model\n      device: cpu\n", r"model m: model_path /nope/model: no such directory"),
        ("models:\n  m:\n    engine:\n      model_path: org/m\n      device: cpu\n      typo_key: 1\n", r"models\.m\.engine\.typo_key: unknown key"),
    ],
)
def test_check_rejects_bad_configs_in_one_line(tmp_path: Path, yaml_text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    result = run_cli("check", str(path))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert re.search(expected, errors[0]), errors[0]
    assert "Traceback" not in result.stderr


def test_launch_unknown_model_and_missing_file(tmp_path: Path) -> None:
    missing = run_cli("launch", str(tmp_path / "absent.yaml"))
    assert missing.returncode == 2 and "absent.yaml: no such file" in missing.stderr
    assert "Traceback" not in missing.stderr
    unknown = run_cli("launch", "configs/qwen2.5-7b-instruct.yaml", "--model", "nope")
    assert unknown.returncode == 2 and "no model named 'nope'" in unknown.stderr


START_ATTEMPTS = 3
"""Fake starts that test_launch_killed_... may need before one of them is the first to look at its orphans."""


@pytest.mark.usefixtures("starts_engine")
def test_launch_killed_takes_its_engine_along_and_ctrl_c_leaves_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A launcher SIGKILLed (a notebook killed, an OOM kill) takes its (real) engine along by the parent-death
    signal; the engine's /dev/shm files stay, with nobody left to remove them, until the next start
    removes them. That next launcher runs until Ctrl-C and leaves nothing behind. The next start is of a FAKE
    engine (tests/fake_engine.py, the config's ``python:``): the launcher removes the files before it spawns
    any engine, and a real engine stopped clean is tests/launch/test_process.py's (one real start less)."""
    env = {**os.environ, "SGLANG_GATEWAY_TINY_MODEL": str(tiny_model_dir), "COLUMNS": "300"}
    argv = [*CLI, "launch", "configs/tiny-cpu.yaml"]
    fake = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    fake["models"]["tiny"]["engine"].update(model_path=str(tiny_model_dir), python=str(fake_engine_python(tmp_path)))
    (tmp_path / "fake.yaml").write_text(yaml.safe_dump(fake))
    with leaves_nothing() as check:
        listed = set(SHM_DIR.iterdir())
        killed = ServerProcess(argv, log_path=tmp_path / "killed.log", env=env)
        check.watch(killed.pid)
        engine_pid = int(killed.wait_log(READY).group(1))
        check.watch(engine_pid)
        # this engine's own files: other xdist workers' engines make theirs meanwhile, and stay alive
        appeared = {path for path in (set(SHM_DIR.iterdir()) - listed) & owned_shm_files(engine_pid) if path.name.startswith("sglang_")}
        assert appeared, "the engine made no /dev/shm file"
        # Other xdist workers start and stop engines meanwhile, and each start or stop removes engine files that no
        # live process uses: this test holds the dead engine's files open until its own next start (so they are in
        # use), dated back so that the start-up sweep, which leaves files younger than ORPHAN_MIN_AGE_S alone, takes
        # them without a wait, and so that no other engine's stop (files written since its start) takes them.
        with contextlib.ExitStack() as held:
            for path in appeared:
                held.enter_context(path.open("rb"))
            os.kill(killed.pid, signal.SIGKILL)  # the launcher only: its engine is in a group of its own
            assert killed.proc.wait(timeout=30) == -signal.SIGKILL
            wait_until(lambda: not group_pids(engine_pid), "the engine to end with its SIGKILLed launcher", 120, every_s=0.5)
            orphans = {path for path in appeared if path.exists()} - shm_in_use(but=[os.getpid()])
            assert orphans, "the dead engine's files are gone or still in use before the next start"
            _date_back(orphans)
            for attempt in range(START_ATTEMPTS):
                held.close()  # released: the next start's to remove
                launcher = ServerProcess([*CLI, "launch", str(tmp_path / "fake.yaml")], log_path=tmp_path / f"launch-{attempt}.log", env=env)
                check.watch(launcher.pid)
                ready = launcher.wait_log(READY)
                pid, url = int(ready.group(1)), ready.group(2)
                check.watch(pid)
                assert not any(path.exists() for path in orphans), "the next start left the dead engine's files"
                removals = [line for line in launcher.log().splitlines() if "/dev/shm file(s) that no live process uses" in line]
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
                assert launcher.stop(signal.SIGINT) == 0
                if removals:
                    assert len(removals) == 1 and all(path.name in removals[0] for path in orphans), removals
                    return
                if attempt + 1 < START_ATTEMPTS:
                    # Only under pytest-xdist or on a shared machine: an engine started or stopped by another process
                    # in the second between the release and this launcher's own look took them first. Again, with
                    # stand-ins: files named as an engine names them, held and dated back the same way.
                    orphans = {SHM_DIR / f"sglang_orphan_test_{os.getpid()}_{attempt}_{n}.shm" for n in range(2)}
                    for path in orphans:
                        path.write_bytes(bytes(64))
                        held.enter_context(path.open("rb"))
                    _date_back(orphans)
            pytest.fail(f"{START_ATTEMPTS} starts in a row found their orphans removed by another engine's start or stop first")


def _date_back(paths: set[Path]) -> None:
    """A day old: past the start-up sweep's ORPHAN_MIN_AGE_S, and older than any other engine's start."""
    when = time.time() - 86400
    for path in paths:
        os.utime(path, (when, when))


def test_check_validates_the_gateway_section_of_a_deployment_of_url_models(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("models:\n  big:\n    url: http://router.internal:30000\ngateway:\n  api_keys_env: CHECK_TEST_KEYS\n")
    missing = run_cli("check", str(path), env={k: v for k, v in os.environ.items() if k != "CHECK_TEST_KEYS"})
    assert missing.returncode == 2 and "gateway.api_keys_env: environment variable CHECK_TEST_KEYS is not set" in missing.stderr
    fine = run_cli("check", str(path), env={**os.environ, "CHECK_TEST_KEYS": "k1,k2"})
    assert fine.returncode == 0, fine.stderr
    assert "# big: external engine at http://router.internal:30000" in fine.stdout
    path.write_text("models:\n  big:\n    url: http://router.internal:30000\ngateway:\n  prot: 1\n")
    typo = run_cli("check", str(path))
    assert typo.returncode == 2 and "gateway.prot: unknown key" in typo.stderr and "Traceback" not in typo.stderr
