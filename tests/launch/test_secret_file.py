"""Engine key files: owner-only, and those a killed launcher left behind are removed by the next start,
but never one a running engine was started with, nor one just written."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from launch.procgroup import cmdline
from launch.secret_file import remove_orphaned_secret_files, write_secret_file
from tests.waiting import wait_until


@pytest.fixture()
def key_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Three key files in a temporary directory of this test's own: the clean-up scans the whole temporary
    directory, and engines started meanwhile by other tests (pytest-xdist workers) clean it up too."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    paths = [write_secret_file({"api-key": f"k{index}"}, "test key/file") for index in range(3)]
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_written_owner_only_with_a_safe_name(key_files: list[Path]) -> None:
    path = key_files[0]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.name.startswith("sglang-gateway-test_key_file-") and path.suffix == ".yaml"
    assert yaml.safe_load(path.read_text()) == {"api-key": "k0"}


def test_only_files_no_live_process_was_started_with_are_removed(key_files: list[Path]) -> None:
    in_use, orphan, young = key_files
    for path in (in_use, orphan):
        os.utime(path, (time.time() - 120, time.time() - 120))
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "--config", str(in_use)], stdin=subprocess.PIPE)
    try:
        # /proc/PID/cmdline reads empty for a moment after Popen returns: wait until the holder names the file
        wait_until(lambda: str(in_use) in cmdline(holder.pid), "the holder's command line to name the file", 10, every_s=0.01)
        removed = remove_orphaned_secret_files()
        assert orphan in removed and not orphan.exists()
        assert in_use.exists() and young.exists() and in_use not in removed and young not in removed
    finally:
        holder.communicate(b"")
    assert in_use in remove_orphaned_secret_files() and not in_use.exists()  # its engine is gone now
