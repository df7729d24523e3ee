"""The owner-only ``--config`` file that hands an engine its API key (never on a command line).

The launcher removes it once the engine is ready (SGLang reads it at start) or stopped. A launcher
killed while its engine was starting leaves it behind: the next engine start removes such files,
those that no live process names on its command line.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import yaml

from launch.procgroup import cmdline, live_pids

PREFIX = "sglang-gateway-"
ORPHAN_MIN_AGE_S = 60.0
"""Younger files may belong to a launcher between writing the file and starting its engine."""


def write_secret_file(data: dict[str, object], name: str) -> Path:
    """Write ``data`` to a new owner-only ``.yaml`` file (SGLang's ``--config`` wants that suffix)."""
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{safe_name(name)}-", suffix=".yaml")  # mode 0600
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(data, handle)
    return Path(path)


def remove_orphaned_secret_files(min_age_s: float = ORPHAN_MIN_AGE_S) -> list[Path]:
    """Remove this user's engine key files that no live process names in its arguments; return them."""
    now, uid = time.time(), os.geteuid()
    candidates = []
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*.yaml"):
        try:
            info = path.stat()
        except OSError:
            continue
        if info.st_uid == uid and now - info.st_mtime >= min_age_s:
            candidates.append(path)
    if not candidates:
        return []
    named = " ".join(cmdline(pid) for pid in live_pids())
    removed = []
    for path in candidates:
        if str(path) not in named:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def safe_name(name: str) -> str:
    """``name`` with anything but letters, digits, ``.``, ``_`` and ``-`` replaced (for file names)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)
