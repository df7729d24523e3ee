"""Engine temporary directories: an engine's ``TMPDIR`` is its own, and the start-up sweep removes only the
directories of launchers that are gone (a live launcher's are kept, however old)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from launch.engine_tmp import PREFIX, engine_tmp_env, make_engine_tmp_dir, remove_orphaned_engine_tmp_dirs


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _aged(path: Path, seconds: float = 120) -> Path:
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_the_sweep_removes_only_directories_of_launchers_that_are_gone(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}{_dead_pid()}-tiny-abc"
    dead.mkdir()
    (dead / "sock").write_text("")
    (dead / "metrics").mkdir()
    _aged(dead)
    mine = tmp_path / f"{PREFIX}{os.getpid()}-tiny-def"
    mine.mkdir()
    _aged(mine)
    other = tmp_path / "sglang-gateway-engine-notapid"
    other.mkdir()
    _aged(other)
    assert remove_orphaned_engine_tmp_dirs(str(tmp_path)) == [dead]
    assert not dead.exists() and mine.exists() and other.exists()


def test_an_engines_tmpdir_is_under_the_one_it_would_have_used_and_keeps_torchs_cache_where_it_was(tmp_path: Path) -> None:
    env = {"TMPDIR": str(tmp_path), "PATH": os.environ.get("PATH", "")}
    private = make_engine_tmp_dir("a/b", env)
    assert private.parent == tmp_path and private.name.startswith(f"{PREFIX}{os.getpid()}-a_b-")
    assert private.stat().st_mode & 0o077 == 0
    engine_env = engine_tmp_env(private, env)
    assert engine_env["TMPDIR"] == str(private)
    assert Path(engine_env["TORCHINDUCTOR_CACHE_DIR"]).parent == tmp_path  # torch's default, as before
    assert engine_tmp_env(private, {**env, "TORCHINDUCTOR_CACHE_DIR": "/x"})["TORCHINDUCTOR_CACHE_DIR"] == "/x"
