"""Find and remove the ``/dev/shm`` files an engine leaves behind.

Each SGLang run leaves ``sglang_loads_*.shm`` and multiprocessing semaphores (``sem.*``) in
``/dev/shm``. A stopping engine removes its own: the files its processes have mapped or open, and
loky semaphores named after one of its pids. An engine whose launcher was SIGKILLed (a notebook
killed, a launcher OOM-killed) dies by its parent-death signal with nobody left to remove its
files: the next engine start removes such orphans, engine files that no live process on the machine
uses. A file another running engine uses is never touched, so engines of several tests, gateways
or users can run side by side.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from launch.procgroup import fd_targets, group_pids, live_pids

SHM_DIR = Path("/dev/shm")
# What SGLang 0.5.23 and the libraries under it leave (its own CI clean-up, sglang/srt/utils/
# stale_shm_cleanup.py, lists the same families), plus multiprocessing's semaphores.
ENGINE_SHM_PATTERNS = (
    "sglang_*",
    "sgl_shm_*",
    "multi_tokenizer_args_*",
    "cuda.shm.*",
    "nccl-*",
    "sem.loky-*",
    "sem.mp-*",
)
ORPHAN_MIN_AGE_S = 10.0
"""The start-up sweep leaves younger files alone: belt and braces for a process still setting one up."""


def _shm_paths_of(pid: int) -> set[Path]:
    found: set[Path] = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(str(SHM_DIR) + "/"):
                found.add(Path(parts[5].removesuffix(" (deleted)")))
    except OSError:
        pass
    for target in fd_targets(pid):
        if target.startswith(str(SHM_DIR) + "/"):
            found.add(Path(target.removesuffix(" (deleted)")))
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


def shm_in_use(but: Iterable[int] = ()) -> set[Path]:
    """``/dev/shm`` files that any live process (other than the pids ``but``) has mapped or open."""
    skipped = set(but)
    used: set[Path] = set()
    for pid in live_pids():
        if pid not in skipped:
            used |= _shm_paths_of(pid)
    return used


def orphaned_shm_files(since: float | None = None, *, min_age_s: float = 0.0) -> set[Path]:
    """This user's engine-style ``/dev/shm`` files that no live process uses.

    ``since`` (epoch seconds): only files modified at or after it (what an engine that died during
    start-up left before its files could be attributed to it). ``min_age_s``: only files at least
    that old. A file another running engine uses is never included.
    """
    if not SHM_DIR.is_dir():
        return set()
    now = time.time()
    uid = os.geteuid()
    candidates: set[Path] = set()
    for pattern in ENGINE_SHM_PATTERNS:
        for path in SHM_DIR.glob(pattern):
            try:
                info = path.stat()
            except OSError:
                continue
            if info.st_uid != uid or (since is not None and info.st_mtime < since) or now - info.st_mtime < min_age_s:
                continue
            candidates.add(path)
    return candidates - shm_in_use() if candidates else set()


def remove_orphaned_shm(min_age_s: float = ORPHAN_MIN_AGE_S) -> list[Path]:
    """Remove engine files that no live process uses (orphans of SIGKILLed launchers); return them."""
    return remove_files(orphaned_shm_files(min_age_s=min_age_s))


def remove_files(paths: Iterable[Path]) -> list[Path]:
    """Remove the files that still exist; return those removed."""
    removed = []
    for path in paths:
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed
