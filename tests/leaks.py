"""The one "leaves nothing behind" check of the tests: no process group left, no ``/dev/shm`` file left, no
engine temporary directory left; and, over a whole test session, no file left in the working tree.

``/dev/shm`` is checked whole: every file in it that no live process has mapped or open is a leak,
unless it was already there, unused, before the check began. Other engines running on the machine
(other tests, other users) use their files, so they never count, and no before/after comparison of
the directory is needed. The product's own idea of which files an engine owns is not used: a bug in
it would hide the very leak this looks for.

Engine temporary directories (``launch.engine_tmp``: each engine's ``TMPDIR``, holding its socket files) are
named after the process that launched the engine: those of this process and of the watched process groups'
leaders that were not there when the check began must be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from launch.engine_tmp import PREFIX as ENGINE_TMP_PREFIX
from launch.procgroup import group_pids, signal_group
from launch.shm import SHM_DIR, shm_in_use
from tests.waiting import wait_until

SETTLE_S = 30.0
"""How long leftovers may take to go (another engine on the machine may be mid-stop meanwhile)."""


def unused_shm_files() -> set[Path]:
    """Files in ``/dev/shm`` that no live process on this machine has mapped or open."""
    files = {path for path in SHM_DIR.iterdir() if path.is_file()} if SHM_DIR.is_dir() else set()
    return files - shm_in_use() if files else set()


def engine_tmp_dirs(launchers: set[int]) -> set[Path]:
    """Engine temporary directories of engines that the processes ``launchers`` started."""
    base = Path(tempfile.gettempdir())
    return {path for pid in launchers for path in base.glob(f"{ENGINE_TMP_PREFIX}{pid}-*")}


TREE_CACHES = frozenset({".pytest_cache/", ".hypothesis/"})
"""What a test run may add to the working tree: pytest's and Hypothesis's own caches (both in ``.gitignore``)."""


def untracked_in_tree(repo: Path) -> set[str] | None:
    """The working tree's paths that git does not track, ignored ones included (a new directory as one entry);
    None outside a git checkout (an unpacked sdist: nothing to compare)."""
    found = subprocess.run(["git", "ls-files", "--others", "--directory"], cwd=repo, capture_output=True, text=True)
    return set(found.stdout.splitlines()) if found.returncode == 0 else None


class LeakCheck:
    """Remembers the process groups a test started and the ``/dev/shm`` files already unused."""

    def __init__(self, shm: bool = True) -> None:
        self.shm = shm
        self.baseline = unused_shm_files() if shm else set()
        self.groups: set[int] = set()
        self.tmp_baseline = engine_tmp_dirs({os.getpid()})

    def watch(self, pgid: int | None) -> None:
        """A process group that must be gone at the end (an engine's pid, a CLI's pid)."""
        if pgid is not None:
            self.groups.add(pgid)

    def leftovers(self) -> tuple[dict[int, set[int]], set[Path], set[Path]]:
        alive = {pgid: pids for pgid in self.groups if (pids := group_pids(pgid))}
        tmp_dirs = engine_tmp_dirs({os.getpid(), *self.groups}) - self.tmp_baseline
        return alive, (unused_shm_files() - self.baseline) if self.shm else set(), tmp_dirs

    def kill_all(self) -> None:
        """SIGKILL every watched group (a failed test must not leave its engines running)."""
        for pgid in self.groups:
            signal_group(pgid, signal.SIGKILL)

    def assert_nothing_left(self, settle_s: float = SETTLE_S) -> None:
        """Until the watched groups are gone and nothing they held is left; fails naming what is still there."""

        def report() -> str:
            alive, files, tmp_dirs = self.leftovers()
            return "; ".join(
                [f"process groups still alive (group: pids): {alive}"] * bool(alive)
                + [f"/dev/shm files that no live process uses were left behind: {sorted(map(str, files))}"] * bool(files)
                + [f"engine temporary directories were left behind: {sorted(map(str, tmp_dirs))}"] * bool(tmp_dirs)
            )

        wait_until(lambda: not any(self.leftovers()), report, settle_s, every_s=0.5)


@contextmanager
def leaves_nothing(shm: bool = True) -> Iterator[LeakCheck]:
    """``with leaves_nothing() as check: ...; check.watch(pid)``: fails if the block leaves anything.

    ``shm=False`` for blocks whose processes map no ``/dev/shm`` (FAKE engines): there the check could only
    see the files of real engines other tests (pytest-xdist workers) kill meanwhile."""
    check = LeakCheck(shm)
    try:
        yield check
    except BaseException:
        check.kill_all()
        raise
    check.assert_nothing_left()
