"""Find and remove the ``/dev/shm`` files an engine leaves behind.

Each SGLang run leaves ``sglang_loads_*.shm`` and multiprocessing semaphores (``sem.*``) in
``/dev/shm``. Only files that belong to *this* engine are removed: the ones its processes have
mapped or open, and loky semaphores named after one of its pids. Another engine's files are never
touched, so engines of several tests or gateways can run side by side.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (index 0 = state, 2 = pgrp, 11/12 = utime/stime)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    return stat[stat.rfind(")") + 2 :].split()


def group_pids(pgid: int) -> set[int]:
    """Pids of the live processes in process group ``pgid``."""
    pids: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None and len(fields) > 2 and int(fields[2]) == pgid:
                pids.add(int(entry.name))
    return pids


def _shm_paths_of(pid: int) -> set[Path]:
    found: set[Path] = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(str(SHM_DIR) + "/"):
                found.add(Path(parts[5].removesuffix(" (deleted)")))
    except OSError:
        pass
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(str(SHM_DIR) + "/"):
                found.add(Path(target.removesuffix(" (deleted)")))
    except OSError:
        pass
    return found


def owned_shm_files(pgid: int) -> set[Path]:
    """``/dev/shm`` files the engine in group ``pgid`` is using now (call before and after stopping)."""
    pids = group_pids(pgid) | {pgid}
    owned: set[Path] = set()
    for pid in pids:
        owned |= _shm_paths_of(pid)
    if SHM_DIR.is_dir():
        for pid in pids:
            owned |= set(SHM_DIR.glob(f"sem.loky-{pid}-*"))
    return owned


_ENGINE_SHM_PATTERNS = ("sglang_*", "sem.loky-*", "sem.mp-*")


def shm_in_use() -> set[Path]:
    """``/dev/shm`` files that any live process has mapped or open."""
    used: set[Path] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            used |= _shm_paths_of(int(entry.name))
    return used


def orphaned_shm_files(since: float) -> set[Path]:
    """Engine-style ``/dev/shm`` files created at or after ``since`` (epoch seconds) that no live process uses.

    Catches what an engine that died during start-up left before its files could be attributed to it;
    a file another running engine uses is never included.
    """
    if not SHM_DIR.is_dir():
        return set()
    candidates: set[Path] = set()
    for pattern in _ENGINE_SHM_PATTERNS:
        for path in SHM_DIR.glob(pattern):
            try:
                if path.stat().st_mtime >= since:
                    candidates.add(path)
            except OSError:
                continue
    return candidates - shm_in_use() if candidates else set()


def remove_files(paths: Iterable[Path]) -> list[Path]:
    """Remove the files that still exist; return those removed."""
    removed = []
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError:
            continue
        removed.append(path)
    return removed
