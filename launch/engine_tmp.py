"""A private temporary directory per engine, removed with it.

An SGLang engine leaves about ten entries in the temporary directory each run: its ZeroMQ socket files and the
empty files it names them after (``NamedTemporaryFile(delete=False)``), and the Prometheus multiprocess directory
of ``--enable-metrics``, which SGLang's own shutdown (a SIGKILL of its process tree) never gets to remove. So each
engine gets ``TMPDIR`` set to a directory of its own, which the launcher removes when it stops the engine. The
directory is named after the launcher's pid: the next engine start removes those of launchers that died (SIGKILLed)
and of engines that died with them.

Torch's compile cache also lives under the temporary directory by default; it is kept where it was
(``TORCHINDUCTOR_CACHE_DIR``) so that it outlives one engine, as it did.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path

from launch.procgroup import pid_alive
from launch.secret_file import safe_name

PREFIX = "sglang-gateway-engine-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-")


def make_engine_tmp_dir(name: str, env: dict[str, str]) -> Path:
    """A new owner-only directory for engine ``name`` under the temporary directory ``env`` names (or this one's)."""
    base = env.get("TMPDIR") or tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{safe_name(name)[:24]}-", dir=base))


def engine_tmp_env(tmp_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``TMPDIR`` set to ``tmp_dir`` (made by :func:`make_engine_tmp_dir`) and Torch's compile cache
    kept where it would have been."""
    inductor_default = str(tmp_dir.parent / f"torchinductor_{_user()}")  # torch's own default, under the old TMPDIR
    return {**env, "TMPDIR": str(tmp_dir), "TORCHINDUCTOR_CACHE_DIR": env.get("TORCHINDUCTOR_CACHE_DIR", inductor_default)}


def remove_engine_tmp_dir(tmp_dir: Path | None) -> None:
    if tmp_dir is not None:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def remove_orphaned_engine_tmp_dirs(base: str | None = None) -> list[Path]:
    """Remove this user's engine directories whose launcher is no longer alive; return them.

    No age is needed to tell them apart: a live launcher's directories are kept whatever their age, and the
    engines of a dead one die with it (its parent-death signal). A reused pid only keeps a directory longer."""
    uid = os.geteuid()
    removed = []
    for path in Path(base or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        try:
            info = path.stat()
        except OSError:
            continue
        if match is None or info.st_uid != uid or pid_alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _user() -> str:
    """The user name as Torch puts it in its cache directory's name."""
    try:
        return re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):
        return f"uid_{os.getuid()}"
